"""Requests the apiserver answers from what it holds: a tenant's sandboxes (a list, one's
status), the nodes, and a sandbox's command history (from the trajectory stream)."""

from __future__ import annotations

from dsec_kernel import bus, deadline
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.contract.placement import NodeView
from dsec_kernel.contract.wire import (
    HistoryRequest,
    HistoryResponse,
    ListRequest,
    ListResponse,
    NodesRequest,
    NodesResponse,
    SandboxInfo,
    StatusRequest,
)
from dsec_kernel.fairshare import TenantSlots
from dsec_kernel.trajectory import Trajectory

__all__ = ["LIST_PAGE_BYTES", "Queries"]

#: most bytes of records one page of ``list`` carries
LIST_PAGE_BYTES = 8 << 20


class Queries:
    """Handlers answered here; ``views`` are the node views (read only)."""

    def __init__(
        self,
        registry: Registry,
        views: dict[str, NodeView],
        trajectory: Trajectory,
    ) -> None:
        self.registry = registry
        self.views = views
        self.trajectory = trajectory
        self._history_reads = TenantSlots(8, 2)  # each may pull up to 32 MiB

    async def list_sandboxes(self, r: ListRequest, call: bus.Call) -> ListResponse:
        """The caller's sandboxes by id, a page at a time: at most ``limit``, and no more
        than :data:`LIST_PAGE_BYTES` of records (one reply must fit a NATS message)."""
        if r.after is None:  # (a list's first page) a sandbox made through another apiserver
            await self.registry.mirror.current()  # a moment ago is listed
        want = r.labels.items()
        page: list[SandboxInfo] = []
        size = 0
        items = self.registry.items
        for sid in sorted(i for i in self.registry.of_tenant(call.tenant) if i > (r.after or "")):
            hit = items.get(sid)
            if hit is None or not want <= hit[0].labels.items():
                continue
            size += len(hit[0].model_dump_json())
            if len(page) == r.limit or (page and size > LIST_PAGE_BYTES):
                return ListResponse(sandboxes=page, next=page[-1].id)
            page.append(hit[0])
        return ListResponse(sandboxes=page)

    async def status(self, r: StatusRequest, call: bus.Call) -> SandboxInfo:
        return await self.registry.lookup(call.tenant, r.id, allow_lost=True)

    async def nodes(self, r: NodesRequest, call: bus.Call) -> NodesResponse:
        """The nodes, with the layers each has used as the caller sees them: public ones and
        its own (another tenant's layers are not named)."""
        own = f"{call.tenant}/"
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

    async def history(self, r: HistoryRequest, call: bus.Call) -> HistoryResponse:
        """From the trajectory stream: works for lost sandboxes, and destroyed ones while
        the stream keeps their entries."""
        tenant = call.tenant
        async with self._history_reads.hold(tenant, deadline.inner(None)):  # a few at a time
            return HistoryResponse(commands=await self.trajectory.read(tenant, r.sandbox_id))
