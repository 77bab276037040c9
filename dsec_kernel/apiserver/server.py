"""The apiserver composed of its parts, and the endpoints it declares."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from typing import Any

from nats.aio.client import Client as NATS
from pydantic import BaseModel

from dsec_kernel import __version__, bus
from dsec_kernel.apiserver.admission import Admission
from dsec_kernel.apiserver.auth import Auth
from dsec_kernel.apiserver.creating import Creating
from dsec_kernel.apiserver.destroying import Destroying
from dsec_kernel.apiserver.edges import Edges
from dsec_kernel.apiserver.leases import Leases
from dsec_kernel.apiserver.liveness import Liveness
from dsec_kernel.apiserver.nodes import Nodes
from dsec_kernel.apiserver.pools import Pools
from dsec_kernel.apiserver.queries import Queries
from dsec_kernel.apiserver.reaper import Reaper
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.apiserver.routing import Routing
from dsec_kernel.apiserver.specs import Specs
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.placement import PlacementPolicy
from dsec_kernel.contract.wire import (
    AcquireRequest,
    CreateRequest,
    DestroyRequest,
    ExecRequest,
    FncallRequest,
    FsDiffRequest,
    HistoryRequest,
    JobCloseRequest,
    JobRenewRequest,
    ListRequest,
    NodesRequest,
    PauseRequest,
    PoolCloseRequest,
    PoolOpenRequest,
    PrestageRequest,
    PublishRequest,
    ReadFileRequest,
    ReleaseRequest,
    RestoreRequest,
    ResumeRequest,
    SnapshotRequest,
    StatusRequest,
    WriteFileRequest,
)
from dsec_kernel.state.facade import ClusterState
from dsec_kernel.trajectory import Trajectory

__all__ = ["ApiServer"]

log = logging.getLogger(__name__)


class ApiServer:
    """``await start()`` to serve; ``await stop()`` drains requests in flight (and undoes
    what a start that failed half way did). Once started, :attr:`state` and
    :attr:`admission` may be read (tests do)."""

    def __init__(
        self,
        nc: NATS,
        settings: ApiSettings,
        hooks: Hooks,
        policy: PlacementPolicy,
        api_nc: NATS | None = None,
    ) -> None:
        """``nc`` carries the cluster's state and the edges' calls; ``api_nc`` (default
        ``nc``) the tenants' requests, so that a tenant flooding the API, should NATS drop
        that connection as a slow consumer, does not also cut the state mirrors."""
        self.nc = nc
        self.api_nc = api_nc or nc
        self.settings = settings
        self.hooks = hooks
        self.policy = policy
        self.state: ClusterState | None = None
        self._stack = AsyncExitStack()

    async def start(self) -> None:
        settings = self.settings
        state = self.state = await ClusterState.open(self.nc, replicas=settings.kv_replicas)
        trajectory = Trajectory(state.js)
        # the parts, each given what it uses. Queued creates may fit whenever a node's room
        # changes: admission is told, though made below (it needs what the nodes feed)
        nodes = Nodes(state, on_room=lambda: admission.pump())
        views = nodes.views
        edges = Edges(self.nc, settings, nodes.down_event)
        registry = Registry(state, views)
        auth = Auth(state)
        destroying = Destroying(state, registry, nodes, edges)
        leases = Leases(state, registry, edges.power, destroying.destroy_all)
        admission = self.admission = Admission(
            settings, state, views, registry, leases.job, edges.power
        )
        specs = Specs(settings, nodes, leases.job, self.hooks)
        creating = Creating(
            settings, state, registry, nodes, edges, specs, admission, self.policy, leases.job
        )
        pools = Pools(
            settings, state, registry, views, specs, creating.admit_and_create,
            destroying.destroy_all, admission.quota_room, edges,
        )  # fmt: skip
        registry.watch(pools.indexed)
        registry.watch(admission.indexed)
        routing = Routing(settings, registry, views, edges)
        queries = Queries(registry, views, trajectory)
        reaper = Reaper(registry, destroying.destroy_sandboxes)
        liveness = Liveness(settings, state, nodes, registry, self.hooks)

        for mirror in (
            nodes.mirror, registry.mirror, auth.tenants, leases.jobs, pools.pools,
            admission.quotas,
        ):  # fmt: skip
            await mirror.start()
            self._stack.push_async_callback(mirror.stop)
        registry.index_all()
        nodes.view_all()
        self.hooks.configure("apiserver", None)
        # every endpoint is a tenant's: the bus authenticates, parses and maps errors
        ops: dict[str, tuple[Any, type[BaseModel]]] = {
            "create": (creating.create, CreateRequest),
            "destroy": (destroying.destroy, DestroyRequest),
            "list": (queries.list_sandboxes, ListRequest),
            "status": (queries.status, StatusRequest),
            "exec": (routing.execute, ExecRequest),
            "fncall": (routing.fncall, FncallRequest),
            "nodes": (queries.nodes, NodesRequest),
            "publish": (routing.publish, PublishRequest),
            "history": (queries.history, HistoryRequest),
            "prestage": (routing.prestage, PrestageRequest),
            "pause": (routing.pause_or_resume("pause"), PauseRequest),
            "resume": (routing.pause_or_resume("resume"), ResumeRequest),
            "job.renew": (leases.renew, JobRenewRequest),
            "job.close": (leases.close, JobCloseRequest),
            "pool.open": (pools.open, PoolOpenRequest),
            "pool.acquire": (pools.acquire, AcquireRequest),
            "pool.release": (pools.release, ReleaseRequest),
            "pool.close": (pools.close, PoolCloseRequest),
            **{
                op: (routing.in_sandbox(op), model)
                for op, model in (
                    ("file.read", ReadFileRequest),
                    ("file.write", WriteFileRequest),
                    ("snapshot", SnapshotRequest),
                    ("restore", RestoreRequest),
                    ("fs_diff", FsDiffRequest),
                )
            },
        }
        _, drain = await bus.serve(
            self.api_nc,
            name="dsec-apiserver",
            version=__version__,
            description="DSec apiserver: sandboxes, commands and files",
            queue_group="apiserver",
            endpoints={
                bus.api_subject(op): bus.Endpoint(handler, request=model, tenant=True)
                for op, (handler, model) in ops.items()
            },
            authenticate=auth.tenant,
            per_caller=settings.requests_per_credential,
            caller_bytes=settings.request_bytes_per_credential,
            accept=bus.replies_to_caller,  # never answer into someone else's inbox
        )
        self._stack.push_async_callback(drain)
        self._stack.push_async_callback(pools.stop)  # (its fills end before the drain)
        tasks = [
            asyncio.create_task(_every(interval, fn))
            for interval, fn in (
                (settings.node_timeout_s / 4, liveness.check),
                (1.0, reaper.reap),
                (settings.lease_check_s, leases.check),
                (settings.pool_fill_s, pools.refill),
                (1.0, admission.rebalance),
            )
        ]
        self._stack.push_async_callback(_cancel, tasks)

    async def stop(self) -> None:
        await self._stack.aclose()


async def _every(interval: float, fn: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await fn()
        except Exception:
            log.exception("%s failed", fn.__qualname__)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with suppress(asyncio.CancelledError):
            await task
