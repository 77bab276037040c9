"""Creating sandboxes: admission, placement, the edges' creates, the records; a create that
fails as a whole is rolled back (``dsec.api.v1.create``, and warm pools' fills)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable

from dsec_kernel import bus
from dsec_kernel.apiserver.admission import Admission
from dsec_kernel.apiserver.edges import Edges, ids_by_node
from dsec_kernel.apiserver.leases import JobLookup
from dsec_kernel.apiserver.nodes import Nodes, Placed
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.apiserver.specs import Specs
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.placement import PlacementPolicy, PlacementRequest
from dsec_kernel.contract.wire import (
    CreateFailure,
    CreateRequest,
    CreateResponse,
    EdgeCreateRequest,
    EdgeCreateResponse,
    EdgeSandbox,
    Error,
    SandboxInfo,
)
from dsec_kernel.state.facade import ClusterState

__all__ = ["Creating", "new_sandbox_id"]

log = logging.getLogger(__name__)


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


class Creating:
    """Every create's way from request to records."""

    def __init__(
        self,
        settings: ApiSettings,
        state: ClusterState,
        registry: Registry,
        nodes: Nodes,
        edges: Edges,
        specs: Specs,
        admission: Admission,
        policy: PlacementPolicy,
        job: JobLookup,
    ) -> None:
        self.settings = settings
        self.state = state
        self.registry = registry
        self.nodes = nodes
        self.edges = edges
        self.specs = specs
        self.admission = admission
        self.policy = policy
        self.job = job
        self._creating: dict[tuple[str, str], asyncio.Future[CreateResponse]] = {}

    async def create(self, r: CreateRequest, call: bus.Call) -> CreateResponse:
        tenant = call.tenant
        r.spec = self.specs.with_backend(r.spec)
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
        if r.request_id and (done := self.registry.created_by(tenant, r.request_id)):
            # sent again (a reconnect): not made twice; of a partial one, those not made
            # then are answered as such (their own error went with the first answer)
            short = r.count - len(done) if r.partial else 0
            why = errors.Unavailable(
                f"{short} of the {r.count} sandboxes were not made when this request was first "
                "sent; create them again"
            )
            failed = [CreateFailure(count=short, error=Error.of(why))] if short > 0 else []
            return CreateResponse(sandboxes=done, failed=failed)
        await self.specs.check_layers(tenant, r.spec)
        return await self.admit_and_create(tenant, r)

    async def admit_and_create(
        self, tenant: str, r: CreateRequest, pool: str | None = None, in_pool: bool = False
    ) -> CreateResponse:
        """Every create's way in: through admission (the tenant's quota, the queue, its
        job's priority) for up to ``r.wait_s``, then :meth:`create_sandboxes`. A partial
        create is admitted for as many as the tenant's quota allows now (the others fail
        with QuotaExceeded); it raises only if it can make none."""
        self.specs.check(tenant, r.spec)
        job = self.job(tenant, r.spec.job) if r.spec.job else None
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
        self.specs.check(tenant, r.spec)
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
            revs = await self.state.put_sandboxes(created)
        except Exception as exc:
            await self._rollback(created)
            try:  # some may have been stored with their acks lost: listed, then reported lost
                await self.state.delete_sandboxes([i.id for i in created])
            except errors.DsecError as gone:
                log.warning("%d record(s) of a failed create may stay (%s)", len(created), gone)
            if isinstance(exc, errors.StateUnavailable):
                raise  # the bus asks again once the stream has a leader
            raise errors.Unavailable(f"could not record the sandboxes: {exc}") from exc
        self.registry.record(created, revs)
        return created, failed

    async def _place_and_create(
        self,
        tenant: str,
        r: CreateRequest,
        todo: list[EdgeSandbox],
        excluded: set[str],
        on_placed: Callable[[], None] | None = None,
    ) -> tuple[list[SandboxInfo], list[EdgeSandbox], errors.DsecError | None]:
        """One placement round: returns (created, still to do, last error)."""
        views = [v for n, v in self.nodes.views.items() if n not in excluded]
        jobs = self.registry.job_nodes(tenant, r.spec.job) if r.spec.job else {}
        nodes = self.policy.place(PlacementRequest(tenant, r.spec, len(todo), jobs), views)
        groups: dict[str, list[EdgeSandbox]] = defaultdict(list)
        for sb, node in zip(todo, nodes, strict=True):
            groups[node].append(sb)
        entries: dict[str, Placed] = {
            node: self.nodes.place(node, r.spec.backend, len(items))
            for node, items in groups.items()
        }
        if on_placed is not None:
            on_placed()  # the nodes' pending counts hold the room from here

        async def one(node: str, items: list[EdgeSandbox]) -> EdgeCreateResponse:
            placed = entries[node]
            data = EdgeCreateRequest(sandboxes=items).model_dump_json().encode()
            try:
                raw = await self.edges.call(node, "create", data, self.settings.edge_timeout_s)
            except BaseException:
                self.nodes.unplace(node, placed)
                raise
            resp = EdgeCreateResponse.model_validate_json(raw)
            self.nodes.made(node, placed, resp.created, resp.completed_at)
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
        try:
            await self.edges.destroy(node, ids)
        except errors.DsecError as exc:  # the edge's reconciliation removes them later
            log.warning("rollback on %s failed (%s); its edge will reconcile", node, exc)
