"""Requests about sandboxes and nodes that the edges answer: commands, fncalls, files,
snapshots, pause and resume, prestaging layers, publishing snapshots. Each goes to the
caller's sandboxes' edges (looked up in the registry) or to nodes that can serve it."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Protocol

from dsec_kernel import bus
from dsec_kernel.apiserver.edges import Edges
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.placement import NodeView
from dsec_kernel.contract.wire import (
    Error,
    ExecRequest,
    ExecResponse,
    ExecResult,
    Failure,
    FncallRequest,
    PauseRequest,
    PauseResponse,
    PrestageRequest,
    PrestageResponse,
    PublishRequest,
    ResumeRequest,
    SandboxInfo,
    fit_results,
)

__all__ = ["EXEC_MARGIN_S", "InSandbox", "Routing"]

#: seconds added to a command's own timeout for its wait for a turn on the node and the
#: round trip through the edge: under the SDK's 30 s (it waits longer than this apiserver,
#: which waits longer than the edge's call to the agent: deadline.inner)
EXEC_MARGIN_S = 28.0


class InSandbox(Protocol):
    """A request about one sandbox (file.read, snapshot...), which its edge answers."""

    sandbox_id: str


class Routing:
    """Handlers that forward to edges; ``views`` are the node views (read only)."""

    def __init__(
        self,
        settings: ApiSettings,
        registry: Registry,
        views: dict[str, NodeView],
        edges: Edges,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.views = views
        self.edges = edges
        self._fncall_inflight: dict[str, int] = defaultdict(int)

    async def execute(self, r: ExecRequest, call: bus.Call) -> bytes | ExecResponse:
        tenant = call.tenant
        timeout = r.timeout_s + EXEC_MARGIN_S
        if len(r.sandbox_ids) == 1:  # the edge's answer as it is; a failure as many would get
            sid = r.sandbox_ids[0]
            try:
                info = await self.registry.lookup(tenant, sid)
                return await self.edges.call(info.node, "exec", call.data, timeout)
            except errors.DsecError as exc:
                return ExecResponse(results=[ExecResult(sandbox_id=sid, exit_code=-1, error=exc)])
        results: dict[str, ExecResult] = {}
        groups: dict[str, list[str]] = defaultdict(list)
        for sid in dict.fromkeys(r.sandbox_ids):
            try:
                groups[(await self.registry.lookup(tenant, sid)).node].append(sid)
            except errors.DsecError as exc:
                results[sid] = ExecResult(sandbox_id=sid, exit_code=-1, error=Error.of(exc))

        async def one(node: str, ids: list[str]) -> None:
            data = r.model_copy(update={"sandbox_ids": ids}).model_dump_json().encode()
            try:
                resp = ExecResponse.model_validate_json(
                    await self.edges.call(node, "exec", data, timeout)
                )
                results.update((x.sandbox_id, x) for x in resp.results)
            except errors.DsecError as exc:
                for sid in ids:
                    results[sid] = ExecResult(sandbox_id=sid, exit_code=-1, error=Error.of(exc))

        await asyncio.gather(*(one(n, ids) for n, ids in groups.items()))
        return ExecResponse(results=fit_results([results[sid] for sid in r.sandbox_ids]))

    async def fncall(self, r: FncallRequest, call: bus.Call) -> bytes:
        tenant = call.tenant
        r.tenant = tenant  # the edge shares fncall slots fairly between tenants
        if r.sandbox_id:
            node = (await self.registry.lookup(tenant, r.sandbox_id)).node
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
            return await self.edges.call(node, "fncall", data, r.timeout_s + EXEC_MARGIN_S)
        finally:
            self._fncall_inflight[node] -= 1

    def pause_or_resume(
        self, op: str
    ) -> Callable[[PauseRequest | ResumeRequest, bus.Call], Awaitable[PauseResponse]]:
        """A handler that pauses or resumes (``op``) the caller's sandboxes, one request per
        node."""

        async def handle(r: PauseRequest | ResumeRequest, call: bus.Call) -> PauseResponse:
            out = PauseResponse()
            found: list[SandboxInfo] = []
            for sid in dict.fromkeys(r.ids):
                try:
                    found.append(await self.registry.lookup(call.tenant, sid))
                except errors.DsecError as exc:
                    out.failed.append(Failure(id=sid, error=Error.of(exc)))
            replies = await self.edges.power(op, found, r.reason)
            for part in replies:
                out.done += part.done
                out.failed += part.failed
            return out

        return handle

    def in_sandbox(self, op: str) -> Callable[[InSandbox, bus.Call], Awaitable[bytes]]:
        """A handler for requests about one of the caller's sandboxes: forwarded to its edge
        as they came, waited for less than the caller waits (the bus cuts every inner call to
        the request's deadline, so the edge knows when to give up too)."""

        async def handle(r: InSandbox, call: bus.Call) -> bytes:
            info = await self.registry.lookup(call.tenant, r.sandbox_id)
            return await self.edges.call(info.node, op, call.data, self.settings.edge_timeout_s)

        return handle

    async def prestage(self, r: PrestageRequest, call: bus.Call) -> PrestageResponse:
        r.tenant = call.tenant  # the layers as that tenant sees them
        nodes = [
            v.name
            for v in self.views.values()
            if v.info.serving and (r.pool is None or v.info.pool == r.pool)
        ]
        if not nodes:
            raise errors.NotFound(f"no node is up in pool {r.pool!r}")
        data = r.model_dump_json().encode()
        timeout = self.settings.edge_timeout_s * 4

        async def one(node: str) -> PrestageResponse:
            try:
                raw = await self.edges.call(node, "prestage", data, timeout)
                return PrestageResponse.model_validate_json(raw)
            except errors.DsecError as exc:
                return PrestageResponse(failed=[Failure(id=node, error=Error.of(exc))])

        out = PrestageResponse()
        for part in await asyncio.gather(*(one(n) for n in nodes)):
            out.nodes += part.nodes
            out.failed += part.failed
        return out

    async def publish(self, r: PublishRequest, call: bus.Call) -> bytes:
        r.tenant = call.tenant  # the edge checks the snapshot belongs to it
        nodes = [
            v.name
            for v in self.views.values()
            if v.info.serving and any(b.capabilities.snapshot for b in v.info.backends)
        ]
        if not nodes:
            raise errors.Unsupported("no node runs a backend that keeps snapshots")
        data = r.model_dump_json().encode()
        return await self.edges.call(nodes[0], "publish", data, self.settings.edge_timeout_s * 10)
