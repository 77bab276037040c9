"""Destroying sandboxes: on their edges, then their records (``dsec.api.v1.destroy``, and
for the parts that destroy: leases, pools, the reaper)."""

from __future__ import annotations

import asyncio

from dsec_kernel import bus
from dsec_kernel.apiserver.edges import Edges, ids_by_node
from dsec_kernel.apiserver.nodes import Nodes
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    DestroyRequest,
    DestroyResponse,
    Error,
    Failure,
    SandboxInfo,
)
from dsec_kernel.state.facade import ClusterState

__all__ = ["Destroying"]


class Destroying:
    """Destroys sandboxes; a destroyed sandbox's room goes back to its node at once."""

    def __init__(
        self,
        state: ClusterState,
        registry: Registry,
        nodes: Nodes,
        edges: Edges,
    ) -> None:
        self.state = state
        self.registry = registry
        self.nodes = nodes
        self.edges = edges

    async def destroy(self, r: DestroyRequest, call: bus.Call) -> DestroyResponse:
        found: list[SandboxInfo] = []
        not_found: list[str] = []
        for sid in dict.fromkeys(r.ids):
            try:
                found.append(await self.registry.lookup(call.tenant, sid, allow_lost=True))
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
        views = self.nodes.views

        def edgeless(i: SandboxInfo) -> bool:  # lost on a node that is up: its edge cleans up
            view = views.get(i.node)
            return view is None or (i.state == "lost" and view.info.state != "up")

        done = [i.id for i in infos if edgeless(i)]
        groups = ids_by_node([i for i in infos if i.id not in done])
        failed: list[Failure] = []

        async def one(node: str, ids: list[str]) -> None:
            try:
                await self.edges.destroy(node, ids)
            except errors.DsecError as exc:
                if views[node].info.state == "down":
                    done.extend(ids)  # the node is gone; so are its sandboxes
                else:
                    failed.extend(Failure(id=i, error=Error.of(exc)) for i in ids)
                return
            done.extend(ids)

        await asyncio.gather(*(one(n, ids) for n, ids in groups.items()))
        await self.state.delete_sandboxes(done)
        gone = set(done)
        left = [info for info in infos if info.id in gone]
        self.registry.forget(left)
        self.nodes.left(left)  # (queued creates may fit now)
        return DestroyResponse(destroyed=done, failed=failed)
