"""The apiserver: authenticates callers, places sandboxes and forwards work to edges.

It serves ``dsec.api.v1.*`` in the queue group ``apiserver``, so any number can run. It holds
no state of its own: nodes, sandboxes and tenants live in JetStream KV and are mirrored in
memory through watches. Every apiserver also watches for nodes whose heartbeats stop: the first
to mark one down (compare-and-set) reports that node's sandboxes lost.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import math
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from dsec_kernel import __version__, bus
from dsec_kernel.admission import Admission
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.placement import NodeView, PlacementPolicy, PlacementRequest
from dsec_kernel.contract.wire import (
    MAX_BATCH,
    CreateFailure,
    CreateRequest,
    CreateResponse,
    DestroyRequest,
    DestroyResponse,
    EdgeCreateRequest,
    EdgeCreateResponse,
    EdgeSandbox,
    Error,
    ExecRequest,
    ExecResponse,
    ExecResult,
    Failure,
    FncallRequest,
    FsDiffRequest,
    HistoryRequest,
    HistoryResponse,
    ListRequest,
    ListResponse,
    NodeInfo,
    NodesResponse,
    PauseRequest,
    PauseResponse,
    PrestageRequest,
    PrestageResponse,
    PublishRequest,
    ReadFileRequest,
    RestoreRequest,
    ResumeRequest,
    SandboxInfo,
    SandboxSpec,
    SnapshotRequest,
    StatusRequest,
    WriteFileRequest,
    fit_results,
)
from dsec_kernel.fairshare import TenantSlots
from dsec_kernel.leases import Leases
from dsec_kernel.pools import Pools
from dsec_kernel.state import LIVE, NODES, SANDBOXES, TENANTS, ClusterState, Mirror
from dsec_kernel.trajectory import Trajectory

__all__ = ["LIST_PAGE_BYTES", "ApiServer"]

#: most bytes of records one page of ``list`` carries
LIST_PAGE_BYTES = 8 << 20

log = logging.getLogger(__name__)

#: seconds added to a command's own timeout for the round trip through the edge
EXEC_MARGIN_S = 15.0


@dataclass
class _Placed:
    """Sandboxes this apiserver placed on a node that its heartbeats may not count yet:
    until one stamped at or after ``done_at`` (the edge's clock) arrives."""

    backend: str
    count: int
    done_at: float = math.inf
    ids: set[str] = field(default_factory=set)


def ids_by_node(infos: list[SandboxInfo]) -> dict[str, list[str]]:
    """Sandbox ids grouped by their node, in the order given."""
    groups: dict[str, list[str]] = defaultdict(list)
    for info in infos:
        groups[info.node].append(info.id)
    return groups


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


class ApiServer:
    """``await start()`` to serve; ``await stop()`` drains requests in flight."""

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
        self.views: dict[str, NodeView] = {}
        self._seen: dict[str, float] = {}
        self._state_was_down = False  # a node-down write found no stream leader
        self._creating: dict[tuple[str, str], asyncio.Future[CreateResponse]] = {}
        self._placed: dict[str, list[_Placed]] = defaultdict(list)
        self._down: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._fncall_inflight: dict[str, int] = defaultdict(int)
        self._history_reads = TenantSlots(8, 2)  # each may pull up to 32 MiB
        self._by_node: dict[str, set[str]] = defaultdict(set)  # node -> sandbox ids
        self._by_tenant: dict[str, set[str]] = defaultdict(set)  # tenant -> sandbox ids
        self._tenant_of: dict[str, str] = {}  # sandbox id -> tenant
        self._job_nodes: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self._job_of: dict[str, tuple[tuple[str, str], str]] = {}  # id -> ((tenant, job), node)
        self.job_members: dict[tuple[str, str], set[str]] = defaultdict(set)  # (tenant, job)
        self._by_request: dict[tuple[str, str], set[str]] = defaultdict(set)  # (tenant, rid)
        self._request_of: dict[str, tuple[str, str]] = {}  # sandbox id -> (tenant, rid)
        self._expiries: list[tuple[float, str]] = []  # heap of (expires_at, sandbox id)
        self._expiry_of: dict[str, float] = {}  # sandbox id -> the expiry pushed for it
        self._tasks: list[asyncio.Task[None]] = []
        self._drain: Any = None
        self._mirrors: list[Mirror[Any]] = []
        self.leases = Leases(self)
        self.pools = Pools(self)
        self.admission = Admission(self)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.state = await ClusterState.open(self.nc, replicas=self.settings.kv_replicas)
        js = self.state.js
        self.trajectory = Trajectory(js)
        self.nodes = Mirror(js, NODES, NodeInfo.model_validate_json, self._node_changed)
        self.sandboxes = Mirror(js, SANDBOXES, SandboxInfo.model_validate_json, self._indexed)
        self.tenants = Mirror(js, TENANTS, lambda b: json.loads(b)["tenant"])
        for m in (self.nodes, self.sandboxes, self.tenants):
            await m.start()
            self._mirrors.append(m)
        self._mirrors.append(await self.leases.start())
        self._mirrors.append(await self.pools.start())
        self._mirrors.append(await self.admission.start())
        for sid, (info, _) in self.sandboxes.items.items():
            self._indexed(sid, info)
        now = time.monotonic()
        for name, (info, _) in self.nodes.items.items():
            self.views[name] = NodeView(info)
            self._seen[name] = now  # a fresh apiserver gives every node a full timeout
        self.hooks.configure("apiserver", None)
        ops = {
            "create": self._create,
            "destroy": self._destroy,
            "list": self._list,
            "status": self._status,
            "exec": self._exec,
            "fncall": self._fncall,
            "nodes": self._nodes,
            "publish": self._publish,
            "history": self._history,
            "prestage": self._prestage,
            "pause": self._power("pause", PauseRequest),
            "resume": self._power("resume", ResumeRequest),
            "job.renew": self.leases.renew,
            "job.close": self.leases.close,
            "pool.open": self.pools.open,
            "pool.acquire": self.pools.acquire,
            "pool.release": self.pools.release,
            "pool.close": self.pools.close,
            **{
                op: self._in_sandbox(op, model)
                for op, model in (
                    ("file.read", ReadFileRequest),
                    ("file.write", WriteFileRequest),
                    ("snapshot", SnapshotRequest),
                    ("restore", RestoreRequest),
                    ("fs_diff", FsDiffRequest),
                )
            },
        }
        _, self._drain = await bus.serve(
            self.api_nc,
            name="dsec-apiserver",
            version=__version__,
            description="DSec apiserver: sandboxes, commands and files",
            queue_group="apiserver",
            endpoints={bus.api_subject(op): h for op, h in ops.items()},
            per_caller=self.settings.requests_per_credential,
            caller_bytes=self.settings.request_bytes_per_credential,
            accept=bus.replies_to_caller,  # never answer into someone else's inbox
        )
        self._tasks = [
            asyncio.create_task(self._loop(self.settings.node_timeout_s / 4, self.check_nodes)),
            asyncio.create_task(self._loop(1.0, self.reap_expired)),
            asyncio.create_task(self._loop(self.settings.lease_check_s, self.leases.check)),
            asyncio.create_task(self._loop(self.settings.pool_fill_s, self.pools.refill)),
            asyncio.create_task(self._loop(1.0, self.admission.rebalance)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with suppress(asyncio.CancelledError):
                await t
        await self.pools.stop()
        if self._drain is not None:
            await self._drain()
        for m in self._mirrors:
            await m.stop()

    async def _loop(self, interval: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:
                log.exception("%s failed", fn.__name__)

    # -- mirrors -----------------------------------------------------------------------------

    def _indexed(self, sandbox_id: str, info: SandboxInfo | None) -> None:
        """Keep the node -> sandboxes and job -> nodes indexes in step with the mirror."""
        self.pools.indexed(sandbox_id, info)
        self.admission.indexed(sandbox_id, info)
        expiry = info.expires_at if info is not None else None
        if expiry is not None and self._expiry_of.get(sandbox_id) != expiry:
            self._expiry_of[sandbox_id] = expiry
            heapq.heappush(self._expiries, (expiry, sandbox_id))
        if info is not None and info.request_id:
            self._request_of[sandbox_id] = (info.tenant, info.request_id)
            self._by_request[(info.tenant, info.request_id)].add(sandbox_id)
        if info is None:
            self._expiry_of.pop(sandbox_id, None)
            if (tenant := self._tenant_of.pop(sandbox_id, None)) is not None:
                self._by_tenant[tenant].discard(sandbox_id)
                if not self._by_tenant[tenant]:
                    del self._by_tenant[tenant]
            for ids in self._by_node.values():
                ids.discard(sandbox_id)
            if (req := self._request_of.pop(sandbox_id, None)) is not None:
                self._by_request[req].discard(sandbox_id)
                if not self._by_request[req]:
                    del self._by_request[req]
            if (old := self._job_of.pop(sandbox_id, None)) is not None:
                self._job_nodes[old[0]][old[1]] -= 1
                self.job_members[old[0]].discard(sandbox_id)
                if not self.job_members[old[0]]:
                    del self.job_members[old[0]]
            return
        self._by_node[info.node].add(sandbox_id)
        self._tenant_of[sandbox_id] = info.tenant
        self._by_tenant[info.tenant].add(sandbox_id)
        if info.job and sandbox_id not in self._job_of:
            key = (info.tenant, info.job)
            self._job_of[sandbox_id] = (key, info.node)
            self._job_nodes[key][info.node] += 1
            self.job_members[key].add(sandbox_id)

    # -- nodes -------------------------------------------------------------------------------

    def _node_changed(self, name: str, info: NodeInfo | None) -> None:
        if info is None:
            self.views.pop(name, None)
            return
        view = self.views.get(name)
        if view is None or (info.heartbeat_at, info.alive_at) != (
            view.info.heartbeat_at, view.info.alive_at,
        ):  # fmt: skip
            self._seen[name] = time.monotonic()
        if view is None:
            view = self.views[name] = NodeView(info)
        view.info = info
        if info.state == "down":
            self._down[name].set()  # calls waiting on this node fail now
        elif self._down[name].is_set():
            self._down[name] = asyncio.Event()  # back up: later calls wait on a fresh event
        # placements a heartbeat already counts go (both times are the edge's clock)
        self._placed[name] = [p for p in self._placed[name] if p.done_at > info.heartbeat_at]
        self._recount(name)
        self.admission.pump()

    def _recount(self, node: str) -> None:
        view = self.views.get(node)
        if view is not None:
            view.pending = {}
            for p in self._placed[node]:
                view.pending[p.backend] = view.pending.get(p.backend, 0) + p.count

    async def check_nodes(self) -> None:
        """Mark nodes down whose heartbeats stopped, and report lost every ready sandbox on a
        down node (including records written after the node went down)."""
        assert self.state is not None
        now = time.monotonic()
        if self._state_was_down:  # heartbeats could not be stored either: silence counts
            try:  # again from when the nodes bucket answers
                await self.state.js.stream_info(f"KV_{NODES}")
            except bus.STATE_DOWN:
                return
            self._state_was_down = False
            self._seen = dict.fromkeys(self._seen, time.monotonic())
            return
        newly_down: list[tuple[NodeInfo, float]] = []
        for name, (info, rev) in list(self.nodes.items.items()):
            silent = now - self._seen.get(name, now)
            grace = self.settings.restart_grace_s if info.stopping_since else None
            if info.state != "up" or silent < (grace or self.settings.node_timeout_s):
                continue
            down = info.model_copy(update={"state": "down"})
            try:
                await self.state.cas_node(down, rev)
            except errors.Conflict:
                continue  # it heartbeated meanwhile, or another apiserver took it
            except bus.STATE_DOWN:  # the nodes bucket is between leaders: so were heartbeats
                self._state_was_down = True
                return
            newly_down.append((down, silent))
        down_nodes = {n for n, (info, _) in self.nodes.items.items() if info.state == "down"}
        down_nodes |= {d.node for d, _ in newly_down}
        lost: dict[str, list[str]] = defaultdict(list)
        for node in down_nodes:
            for sid in list(self._by_node.get(node, ())):
                hit = self.sandboxes.items.get(sid)
                if hit is None or hit[0].state not in LIVE:
                    continue
                with suppress(errors.Conflict):
                    await self.state.cas_sandbox(
                        hit[0].model_copy(update={"state": "lost"}), hit[1]
                    )
                    lost[node].append(sid)
        for down, silent in newly_down:
            log.warning(
                "node %s silent for %.1fs: down, %d sandbox(es) lost",
                down.node,
                silent,
                len(lost[down.node]),
            )
            await self.hooks.node_down(down, lost[down.node])

    async def _nodes(self, req: bus.Request) -> NodesResponse:
        """The nodes, with the layers each has used as the caller sees them: public ones and
        its own (another tenant's layers are not named)."""
        own = f"{await self._auth(req)}/"
        return NodesResponse(
            nodes=[
                v.info.model_copy(
                    update={
                        "layers": [
                            x.removeprefix(own)
                            for x in v.info.layers
                            if "/" not in x or x.startswith(own)
                        ]
                    }
                )
                for v in self.views.values()
            ]
        )

    # -- helpers -----------------------------------------------------------------------------

    async def _auth(self, req: bus.Request) -> str:
        """The tenant whose token the request carries (Unauthenticated if none). Its answer
        can only go to that token's own inbox: others were dropped (bus.replies_to_caller)."""
        token = (req.headers or {}).get(bus.TOKEN_HEADER)
        tenant = self.tenants.get(bus.token_key(token)) if token else None
        if tenant is None and token:  # a tenant created a moment ago, not yet mirrored
            with suppress(Exception):
                entry = await self.state.tenants.get(bus.token_key(token))  # type: ignore[union-attr]
                tenant = json.loads(entry.value)["tenant"]
        if tenant is None:
            raise errors.Unauthenticated(
                "missing or unknown credential: pass token= / set DSEC_TOKEN, or use the "
                "connection file that `dsec up` writes"
            )
        return tenant

    async def _lookup(self, tenant: str, sandbox_id: str, allow_lost: bool = False) -> SandboxInfo:
        """The caller's sandbox, or NotFound / SandboxLost (unless ``allow_lost``)."""
        info = self.sandboxes.get(sandbox_id)
        if info is None:
            assert self.state is not None
            hit = await self.state.get_sandbox(sandbox_id)  # created through another apiserver
            info = hit[0] if hit else None
        if info is None or info.tenant != tenant:
            raise errors.NotFound(f"no sandbox {sandbox_id} (destroyed, expired, or not yours)")
        view = self.views.get(info.node)
        if info.state in LIVE and view is not None and view.info.state == "down":
            info = info.model_copy(update={"state": "lost"})  # its record is being marked
        if info.state == "lost" and not allow_lost:
            raise errors.SandboxLost(
                f"sandbox {sandbox_id} was lost when node {info.node} went down; create a new one"
            )
        return info

    async def _edge(self, node: str, op: str, data: bytes, timeout: float) -> bytes:
        """Call a node's edge; fails early with Unavailable if the node is marked down."""
        down = self._down[node]
        call = asyncio.ensure_future(
            bus.request_raw(self.nc, bus.edge_subject(node, op), data, timeout=timeout)
        )
        waiter = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({call, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not call.done():
            call.cancel()
            raise errors.Unavailable(f"node {node} went down during the request")
        return call.result()

    # -- sandboxes ---------------------------------------------------------------------------

    async def _create(self, req: bus.Request) -> CreateResponse:
        tenant = await self._auth(req)
        r = CreateRequest.model_validate_json(req.data)
        r.spec = self.with_backend(r.spec)
        if not r.request_id:
            return await self._create_once(tenant, r)
        key = (tenant, r.request_id)
        run = self._creating.get(key)  # (sent again while it runs here: its first run's)
        if run is None:
            run = self._creating[key] = asyncio.ensure_future(self._create_once(tenant, r))
            run.add_done_callback(lambda _: self._creating.pop(key, None))
        return await asyncio.shield(run)  # a caller gone leaves the run going

    async def _create_once(self, tenant: str, r: CreateRequest) -> CreateResponse:
        """A create, answered by what its request id made before if it was sent before."""
        if r.request_id and (done := self._created_by(tenant, r.request_id)):
            # sent again (a reconnect): not made twice; of a partial one, those not made
            # then are answered as such (their own error went with the first answer)
            short = r.count - len(done) if r.partial else 0
            why = errors.Unavailable(
                f"{short} of the {r.count} sandboxes were not made when this request was first "
                "sent; create them again"
            )
            failed = [CreateFailure(count=short, error=Error.of(why))] if short > 0 else []
            return CreateResponse(sandboxes=done, failed=failed)
        return await self.admit_and_create(tenant, r)

    async def admit_and_create(
        self, tenant: str, r: CreateRequest, pool: str | None = None, in_pool: bool = False
    ) -> CreateResponse:
        """Every create's way in: through admission (the tenant's quota, the queue, its
        job's priority) for up to ``r.wait_s``, then :meth:`create_sandboxes`. A partial
        create is admitted for as many as the tenant's quota allows now (the others fail
        with QuotaExceeded); it raises only if it can make none."""
        self.check_spec(tenant, r.spec)
        job = self.leases.job(tenant, r.spec.job) if r.spec.job else None
        priority = job.priority if job else 0
        asked = r.count
        fit, over = self.admission.quota_fit(tenant, r.spec, asked) if r.partial else (asked, None)
        if over is not None:
            if fit == 0:
                raise over
            r = r.model_copy(update={"count": fit})
        deadline = time.monotonic() + r.wait_s
        while True:
            wait = max(0.0, deadline - time.monotonic())
            async with self.admission.admitted(tenant, r.spec, r.count, wait, priority) as held:
                try:
                    made, failed = await self.create_sandboxes(
                        tenant, r, pool=pool, in_pool=in_pool, on_placed=held.placed
                    )
                    break
                except errors.CapacityExceeded:  # the nodes filled up between admission and
                    if time.monotonic() >= deadline:  # placement: queue again while time is left
                        raise
            await asyncio.sleep(0.05)
        if over is not None:
            failed.append(CreateFailure(count=asked - fit, error=Error.of(over)))
        return CreateResponse(
            sandboxes=made, failed=failed, queued_s=held.waited, queue_position=held.position
        )

    async def create_sandboxes(
        self,
        tenant: str,
        r: CreateRequest,
        pool: str | None = None,
        in_pool: bool = False,
        on_placed: Callable[[], None] | None = None,
    ) -> tuple[list[SandboxInfo], list[CreateFailure]]:
        """Create and record ``r.count`` sandboxes for ``tenant`` (members of warm pool
        ``pool``, waiting in it with ``in_pool``): all of them, or none and the error raised;
        with ``r.partial``, those the nodes made, and the others as a failure (raised if
        none was made). A sandbox not made leaves nothing on any node."""
        self.check_spec(tenant, r.spec)
        now = time.time()
        expires = now + r.spec.ttl_s if r.spec.ttl_s else None
        todo = [
            EdgeSandbox(
                id=new_sandbox_id(), tenant=tenant, spec=r.spec, created_at=now, expires_at=expires
            )
            for _ in range(r.count)
        ]
        created: list[SandboxInfo] = []
        excluded: set[str] = set()
        error: errors.DsecError | None = None
        for _attempt in range(3):
            try:
                created_now, todo, error = await self._place_and_create(
                    tenant, r, todo, excluded, on_placed
                )
            except errors.DsecError as exc:
                error = exc
                break
            created += created_now
            if not todo or (error is not None and not error.retryable):
                break
        error = error or errors.Internal("creation failed")
        if todo and not (r.partial and created):
            await self._rollback(created)
            raise error
        failed = [CreateFailure(count=len(todo), error=Error.of(error))] if todo else []
        extra = {"request_id": r.request_id} if r.request_id else {}
        if pool is not None:
            extra |= {"pool": pool, "in_pool": in_pool}
        if extra:
            created = [i.model_copy(update=extra) for i in created]
        try:
            revs = await self.state.put_sandboxes(created)  # type: ignore[union-attr]
        except Exception as exc:
            await self._rollback(created)
            try:  # some may have been stored with their acks lost: listed, then reported lost
                await self.state.delete_sandboxes([i.id for i in created])  # type: ignore[union-attr]
            except errors.DsecError as gone:
                log.warning("%d record(s) of a failed create may stay (%s)", len(created), gone)
            if isinstance(exc, errors.StateUnavailable):
                raise  # the bus asks again once the stream has a leader
            raise errors.Unavailable(f"could not record the sandboxes: {exc}") from exc
        for info in created:
            self.sandboxes.items[info.id] = (info, revs[info.id])
            self._indexed(info.id, info)
        return created, failed

    def _created_by(self, tenant: str, request_id: str) -> list[SandboxInfo]:
        ids = self._by_request.get((tenant, request_id), ())
        hits = [self.sandboxes.items.get(i) for i in sorted(ids)]
        return [h[0] for h in hits if h is not None]

    def with_backend(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with the cluster's default backend if it names none (InvalidArgument when
        the operator set no default)."""
        if spec.backend is not None:
            return spec
        if self.settings.default_backend is None:
            known = sorted({b.name for v in self.views.values() for b in v.info.backends})
            raise errors.InvalidArgument(
                "name a backend: this cluster has no default (DSEC_DEFAULT_BACKEND of its "
                f"apiservers; `dsec up` sets it); it runs {', '.join(known) or 'none yet'}"
            )
        return spec.model_copy(update={"backend": self.settings.default_backend})

    def check_spec(self, tenant: str, spec: SandboxSpec) -> None:
        """Raise the typed error a create of ``spec`` would meet before reaching a node."""
        backend = spec.backend
        if not any(v.info.backend(backend) for v in self.views.values()):
            known = sorted({b.name for v in self.views.values() for b in v.info.backends})
            raise errors.UnknownBackend(
                f"no node runs backend {backend!r}; backends in this cluster: "
                f"{', '.join(known) or 'none (is an edge running?)'}"
            )
        if spec.job:
            job = self.leases.job(tenant, spec.job)
            if job is None:
                raise errors.InvalidArgument(
                    f"no job {spec.job!r}: open it first (`async with client.job(...)`)"
                )
            if job.state != "active":
                raise errors.SandboxPaused(
                    f"job {spec.job!r}: its lease lapsed; renew it before creating more"
                )
        if spec.snapshot and not any(
            (b := v.info.backend(backend)) and b.capabilities.fork for v in self.views.values()
        ):
            raise errors.Unsupported(
                f"backend {backend!r} cannot start sandboxes from a snapshot (no fork capability)"
            )

    async def _place_and_create(
        self,
        tenant: str,
        r: CreateRequest,
        todo: list[EdgeSandbox],
        excluded: set[str],
        on_placed: Callable[[], None] | None = None,
    ) -> tuple[list[SandboxInfo], list[EdgeSandbox], errors.DsecError | None]:
        """One placement round: returns (created, still to do, last error)."""
        views = [v for n, v in self.views.items() if n not in excluded]
        jobs = dict(self._job_nodes[(tenant, r.spec.job)]) if r.spec.job else {}
        nodes = self.policy.place(PlacementRequest(tenant, r.spec, len(todo), jobs), views)
        groups: dict[str, list[EdgeSandbox]] = defaultdict(list)
        for sb, node in zip(todo, nodes, strict=True):
            groups[node].append(sb)
        entries: dict[str, _Placed] = {}
        for node, items in groups.items():
            entries[node] = _Placed(r.spec.backend, len(items))
            self._placed[node].append(entries[node])
            self._recount(node)
        if on_placed is not None:
            on_placed()  # the nodes' pending counts hold the room from here

        async def one(node: str, items: list[EdgeSandbox]) -> EdgeCreateResponse:
            placed = entries[node]
            data = EdgeCreateRequest(sandboxes=items).model_dump_json().encode()
            try:
                raw = await self._edge(node, "create", data, self.settings.edge_timeout_s)
            except BaseException:
                with suppress(ValueError):
                    self._placed[node].remove(placed)
                self._recount(node)
                raise
            resp = EdgeCreateResponse.model_validate_json(raw)
            placed.count, placed.done_at = len(resp.created), resp.completed_at
            placed.ids = {info.id for info in resp.created}
            self._recount(node)
            return resp

        results = await asyncio.gather(
            *(one(n, items) for n, items in groups.items()), return_exceptions=True
        )
        created: list[SandboxInfo] = []
        retry: list[EdgeSandbox] = []
        error: errors.DsecError | None = None
        for (node, items), res in zip(groups.items(), results, strict=True):
            if isinstance(res, BaseException):
                # the edge may have made them all the same (its answer timed out, or was too
                # big to send): they are destroyed there, and the retry makes new ones
                await self._rollback_ids(node, [sb.id for sb in items])
                if not isinstance(res, errors.DsecError):
                    raise res
                error = res
                excluded.add(node)
                retry += [sb.model_copy(update={"id": new_sandbox_id()}) for sb in items]
                continue
            created += res.created
            by_id = {sb.id: sb for sb in items}
            for f in res.failed:
                error = errors.error_class(f.error.code)(
                    f"node {node}: {f.error.message}", retryable=f.error.retryable
                )
                excluded.add(node)
                retry.append(by_id[f.id])
        return created, retry, error

    async def _rollback(self, created: list[SandboxInfo]) -> None:
        """Destroy sandboxes of a create that failed as a whole."""
        for node, ids in ids_by_node(created).items():
            await self._rollback_ids(node, ids)

    async def _rollback_ids(self, node: str, ids: list[str]) -> None:
        """Destroy ``ids`` on ``node`` (made or not: destroy is idempotent)."""
        data = DestroyRequest(ids=ids).model_dump_json().encode()
        try:
            await self._edge(node, "destroy", data, self.settings.edge_timeout_s)
        except errors.DsecError as exc:  # the edge's reconciliation removes them later
            log.warning("rollback on %s failed (%s); its edge will reconcile", node, exc)

    async def _destroy(self, req: bus.Request) -> DestroyResponse:
        tenant = await self._auth(req)
        r = DestroyRequest.model_validate_json(req.data)
        found: list[SandboxInfo] = []
        not_found: list[str] = []
        for sid in dict.fromkeys(r.ids):
            try:
                found.append(await self._lookup(tenant, sid, allow_lost=True))
            except errors.NotFound:
                not_found.append(sid)
        out = await self.destroy_sandboxes(found)
        out.not_found = not_found
        return out

    async def destroy_all(self, infos: list[SandboxInfo]) -> list[str]:
        """:meth:`destroy_sandboxes` for callers that answer as a whole: the ids destroyed,
        or the first failure's error raised (after the others were destroyed)."""
        out = await self.destroy_sandboxes(infos)
        if out.failed:
            raise out.failed[0].error.exception()
        return out.destroyed

    async def destroy_sandboxes(self, infos: list[SandboxInfo]) -> DestroyResponse:
        """Destroy on their edges (those lost with their node need none), then delete the
        records. Returns the ids destroyed, and as ``failed`` those whose edge could not
        destroy them now (their records stay; destroying them again is safe)."""
        assert self.state is not None

        def edgeless(i: SandboxInfo) -> bool:  # lost on a node that is up: its edge cleans up
            view = self.views.get(i.node)
            return view is None or (i.state == "lost" and view.info.state != "up")

        done = [i.id for i in infos if edgeless(i)]
        groups = ids_by_node([i for i in infos if i.id not in done])
        failed: list[Failure] = []

        async def one(node: str, ids: list[str]) -> None:
            data = DestroyRequest(ids=ids).model_dump_json().encode()
            try:
                await self._edge(node, "destroy", data, self.settings.edge_timeout_s)
            except errors.DsecError as exc:
                if self.views[node].info.state == "down":
                    done.extend(ids)  # the node is gone; so are its sandboxes
                else:
                    failed.extend(Failure(id=i, error=Error.of(exc)) for i in ids)
                return
            done.extend(ids)

        await asyncio.gather(*(one(n, ids) for n, ids in groups.items()))
        await self.state.delete_sandboxes(done)
        gone = set(done)
        for info in infos:
            if info.id in gone:
                self.sandboxes.items.pop(info.id, None)
                self._indexed(info.id, None)
                self._left(info)
        self.admission.pump()
        return DestroyResponse(destroyed=done, failed=failed)

    def _left(self, info: SandboxInfo) -> None:
        """Count a destroyed sandbox out of its node's load now, not at the next heartbeat
        (which then brings the node's own figures), so that queued creates get its room."""
        view = self.views.get(info.node)
        if view is None:
            return
        for placed in self._placed[info.node]:  # not in a heartbeat yet: counted as pending
            if info.id in placed.ids:
                placed.ids.discard(info.id)
                placed.count -= 1
                self._recount(info.node)
                return
        load = view.info.load
        load.by_backend[info.backend] = max(0, load.by_backend.get(info.backend, 0) - 1)
        if info.state == "paused":
            paused = load.paused_by_backend
            paused[info.backend] = max(0, paused.get(info.backend, 0) - 1)

    async def reap_expired(self) -> None:
        """Destroy sandboxes past their TTL (from a heap of expiries: stale entries, of
        sandboxes gone or seen twice, are skipped)."""
        now = time.time()
        due: dict[str, SandboxInfo] = {}
        while self._expiries and self._expiries[0][0] < now:
            _, sid = heapq.heappop(self._expiries)
            hit = self.sandboxes.items.get(sid)
            if hit is not None and hit[0].expires_at is not None and hit[0].expires_at < now:
                due[sid] = hit[0]
        expired = list(due.values())
        if expired:
            log.info("destroying %d sandbox(es) past their ttl", len(expired))
            try:
                await self.destroy_sandboxes(expired)
            finally:  # those still here (their edge did not answer) are tried again
                for info in expired:
                    if info.id in self.sandboxes.items:
                        heapq.heappush(self._expiries, (info.expires_at or now, info.id))

    async def _list(self, req: bus.Request) -> ListResponse:
        """The caller's sandboxes by id, a page at a time: at most ``limit``, and no more
        than :data:`LIST_PAGE_BYTES` of records (one reply must fit a NATS message)."""
        tenant = await self._auth(req)
        r = ListRequest.model_validate_json(req.data)
        if r.after is None:  # (a list's first page) a sandbox made through another apiserver
            await self.sandboxes.current()  # a moment ago is listed
        want = r.labels.items()
        page: list[SandboxInfo] = []
        size = 0
        for sid in sorted(i for i in self._by_tenant.get(tenant, ()) if i > (r.after or "")):
            hit = self.sandboxes.items.get(sid)
            if hit is None or not want <= hit[0].labels.items():
                continue
            size += len(hit[0].model_dump_json())
            if len(page) == r.limit or (page and size > LIST_PAGE_BYTES):
                return ListResponse(sandboxes=page, next=page[-1].id)
            page.append(hit[0])
        return ListResponse(sandboxes=page)

    async def _status(self, req: bus.Request) -> SandboxInfo:
        tenant = await self._auth(req)
        r = StatusRequest.model_validate_json(req.data)
        return await self._lookup(tenant, r.id, allow_lost=True)

    # -- work --------------------------------------------------------------------------------

    async def _exec(self, req: bus.Request) -> bytes | ExecResponse:
        tenant = await self._auth(req)
        r = ExecRequest.model_validate_json(req.data)
        timeout = r.timeout_s + EXEC_MARGIN_S
        if len(r.sandbox_ids) == 1:  # the edge's answer as it is; a failure as many would get
            sid = r.sandbox_ids[0]
            try:
                info = await self._lookup(tenant, sid)
                return await self._edge(info.node, "exec", req.data, timeout)
            except errors.DsecError as exc:
                return ExecResponse(results=[ExecResult(sandbox_id=sid, exit_code=-1, error=exc)])
        results: dict[str, ExecResult] = {}
        groups: dict[str, list[str]] = defaultdict(list)
        for sid in dict.fromkeys(r.sandbox_ids):
            try:
                groups[(await self._lookup(tenant, sid)).node].append(sid)
            except errors.DsecError as exc:
                results[sid] = ExecResult(sandbox_id=sid, exit_code=-1, error=Error.of(exc))

        async def one(node: str, ids: list[str]) -> None:
            data = r.model_copy(update={"sandbox_ids": ids}).model_dump_json().encode()
            try:
                resp = ExecResponse.model_validate_json(
                    await self._edge(node, "exec", data, timeout)
                )
                results.update((x.sandbox_id, x) for x in resp.results)
            except errors.DsecError as exc:
                for sid in ids:
                    results[sid] = ExecResult(sandbox_id=sid, exit_code=-1, error=Error.of(exc))

        await asyncio.gather(*(one(n, ids) for n, ids in groups.items()))
        return ExecResponse(results=fit_results([results[sid] for sid in r.sandbox_ids]))

    async def _fncall(self, req: bus.Request) -> bytes:
        tenant = await self._auth(req)
        r = FncallRequest.model_validate_json(req.data)
        r.tenant = tenant  # the edge shares fncall slots fairly between tenants
        if r.sandbox_id:
            node = (await self._lookup(tenant, r.sandbox_id)).node
        else:
            serving = [
                v.name
                for v in self.views.values()
                if v.info.serving
                and any(r.language in b.capabilities.fncall_languages for b in v.info.backends)
            ]
            if not serving:
                raise errors.Unsupported(f"no node serves {r.language!r} fncalls")
            node = min(
                serving,
                key=lambda n: self._fncall_inflight[n] + self.views[n].info.load.running_execs,
            )
        self._fncall_inflight[node] += 1
        try:
            data = r.model_dump_json().encode()
            return await self._edge(node, "fncall", data, r.timeout_s + EXEC_MARGIN_S)
        finally:
            self._fncall_inflight[node] -= 1

    def _power(self, op: str, model: type[PauseRequest | ResumeRequest]) -> bus.Handler:
        """Pause or resume the caller's sandboxes, one request per node."""

        async def handle(req: bus.Request) -> PauseResponse:
            tenant = await self._auth(req)
            r = model.model_validate_json(req.data)
            out = PauseResponse()
            found: list[SandboxInfo] = []
            for sid in dict.fromkeys(r.ids):
                try:
                    found.append(await self._lookup(tenant, sid))
                except errors.DsecError as exc:
                    out.failed.append(Failure(id=sid, error=Error.of(exc)))
            replies = await self.power(op, found, r.reason)
            for part in replies:
                out.done += part.done
                out.failed += part.failed
            return out

        return handle

    async def power(
        self, op: str, infos: list[SandboxInfo], reason: str | None
    ) -> list[PauseResponse]:
        """Pause or resume (``op``) these sandboxes, one request per node and batch; an
        edge that does not answer fails its part."""
        model = PauseRequest if op == "pause" else ResumeRequest
        batches = [
            (node, ids[i : i + MAX_BATCH])
            for node, ids in ids_by_node(infos).items()
            for i in range(0, len(ids), MAX_BATCH)
        ]

        async def one(node: str, ids: list[str]) -> PauseResponse:
            data = model(ids=ids, reason=reason).model_dump_json().encode()
            try:
                raw = await self._edge(node, op, data, self.settings.edge_timeout_s)
                return PauseResponse.model_validate_json(raw)
            except errors.DsecError as exc:
                return PauseResponse(failed=[Failure(id=i, error=Error.of(exc)) for i in ids])

        return await asyncio.gather(*(one(n, ids) for n, ids in batches))

    async def _history(self, req: bus.Request) -> HistoryResponse:
        """From the trajectory stream: works for lost sandboxes, and destroyed ones while
        the stream keeps their entries."""
        tenant = await self._auth(req)
        r = HistoryRequest.model_validate_json(req.data)
        async with self._history_reads.hold(tenant, bus.time_left()):  # a few at a time, fairly
            return HistoryResponse(commands=await self.trajectory.read(tenant, r.sandbox_id))

    def _in_sandbox(self, op: str, model: type[Any]) -> bus.Handler:
        """A handler for requests about one of the caller's sandboxes: forwarded to its edge
        as they came (``model`` has a ``sandbox_id``), waited for no longer than the caller
        waits (so the edge knows when to give up too)."""

        async def handle(req: bus.Request) -> bytes:
            r = model.model_validate_json(req.data)
            info = await self._lookup(await self._auth(req), r.sandbox_id)
            timeout, left = self.settings.edge_timeout_s, bus.time_left()
            if left is not None:
                timeout = min(timeout, left)
            return await self._edge(info.node, op, req.data, timeout)

        return handle

    async def _prestage(self, req: bus.Request) -> PrestageResponse:
        r = PrestageRequest.model_validate_json(req.data)
        r.tenant = await self._auth(req)  # the layers as that tenant sees them
        nodes = [
            v.name
            for v in self.views.values()
            if v.info.serving and (r.pool is None or v.info.pool == r.pool)
        ]
        if not nodes:
            raise errors.NotFound(f"no node is up in pool {r.pool!r}")
        data = r.model_dump_json().encode()

        async def one(node: str) -> PrestageResponse:
            try:
                raw = await self._edge(node, "prestage", data, self.settings.edge_timeout_s * 4)
                return PrestageResponse.model_validate_json(raw)
            except errors.DsecError as exc:
                return PrestageResponse(failed=[Failure(id=node, error=Error.of(exc))])

        out = PrestageResponse()
        for part in await asyncio.gather(*(one(n) for n in nodes)):
            out.nodes += part.nodes
            out.failed += part.failed
        return out

    async def _publish(self, req: bus.Request) -> bytes:
        r = PublishRequest.model_validate_json(req.data)
        r.tenant = await self._auth(req)  # the edge checks the snapshot belongs to it
        nodes = [
            v.name
            for v in self.views.values()
            if v.info.serving and any(b.capabilities.snapshot for b in v.info.backends)
        ]
        if not nodes:
            raise errors.Unsupported("no node runs a backend that keeps snapshots")
        data = r.model_dump_json().encode()
        return await self._edge(nodes[0], "publish", data, self.settings.edge_timeout_s * 10)
