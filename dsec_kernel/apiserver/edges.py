"""Calls from the apiserver to the nodes' edges (``dsec.edge.<node>.v1.*``)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS

from dsec_kernel import bus
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    MAX_BATCH,
    DestroyRequest,
    Error,
    Failure,
    PauseRequest,
    PauseResponse,
    ResumeRequest,
    SandboxInfo,
)

__all__ = ["Edges", "Power", "ids_by_node"]

#: ``power(op, infos, reason)``: pause or resume sandboxes (:meth:`Edges.power`)
Power = Callable[[str, list[SandboxInfo], str | None], Awaitable[list[PauseResponse]]]


def ids_by_node(infos: list[SandboxInfo]) -> dict[str, list[str]]:
    """Sandbox ids grouped by their node, in the order given."""
    groups: dict[str, list[str]] = defaultdict(list)
    for info in infos:
        groups[info.node].append(info.id)
    return groups


class Edges:
    """Calls to edges over ``nc``; ``down(node)`` is the event set while a node is down."""

    def __init__(
        self, nc: NATS, settings: ApiSettings, down: Callable[[str], asyncio.Event]
    ) -> None:
        self.nc = nc
        self.settings = settings
        self._down = down

    async def call(self, node: str, op: str, data: bytes, timeout: float) -> bytes:
        """Call a node's edge; fails early with Unavailable if the node is marked down."""
        down = self._down(node)
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

    async def destroy(self, node: str, ids: list[str]) -> None:
        """Destroy ``ids`` on ``node`` (made or not: destroy is idempotent)."""
        data = DestroyRequest(ids=ids).model_dump_json().encode()
        await self.call(node, "destroy", data, self.settings.edge_timeout_s)

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
                raw = await self.call(node, op, data, self.settings.edge_timeout_s)
                return PauseResponse.model_validate_json(raw)
            except errors.DsecError as exc:
                return PauseResponse(failed=[Failure(id=i, error=Error.of(exc)) for i in ids])

        return await asyncio.gather(*(one(n, ids) for n, ids in batches))
