"""A warm pool of ready sandboxes (see :meth:`AsyncClient.pool`)."""

from __future__ import annotations

from dsec_kernel.contract.wire import (
    AcquireRequest,
    AcquireResponse,
    DestroyResponse,
    PoolCloseRequest,
    PoolInfo,
    ReleaseRequest,
)
from dsec_kernel.sdk.sandbox import Sandbox, SandboxClient

__all__ = ["Pool"]


class Pool:
    """Ready sandboxes of one spec, kept by the platform for this tenant.

    :meth:`acquire` hands one out (made on the spot if the pool is empty, which also makes
    the platform keep more ready); :meth:`release` resets it to its clean state and puts it
    back. The pool outlives this handle; :meth:`close` (or leaving ``async with``) destroys
    the sandboxes waiting in it.
    """

    def __init__(self, client: SandboxClient, info: PoolInfo) -> None:
        self._client = client
        self.info = info
        self.name = info.name

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def acquire(self) -> Sandbox:
        """One ready sandbox, yours until :meth:`release` (or destroy)."""
        (sb,) = await self.acquire_many(1)
        return sb

    async def acquire_many(self, count: int) -> list[Sandbox]:
        """``count`` ready sandboxes at once (see :meth:`acquire`)."""
        req = AcquireRequest(name=self.name, count=count)
        resp = await self._client._call("pool.acquire", req, AcquireResponse)
        return [Sandbox(self._client, info) for info in resp.sandboxes]

    async def release(self, sandboxes: Sandbox | list[Sandbox]) -> list[str]:
        """Reset and return sandboxes to the pool; returns the ids that were destroyed
        instead (they could not be reset, or the pool is full)."""
        items = sandboxes if isinstance(sandboxes, list) else [sandboxes]
        req = ReleaseRequest(name=self.name, ids=[sb.id for sb in items])
        return (await self._client._call("pool.release", req, DestroyResponse)).destroyed

    async def close(self) -> list[str]:
        """Destroy the sandboxes waiting in the pool and forget it (acquired ones stay)."""
        req = PoolCloseRequest(name=self.name)
        return (await self._client._call("pool.close", req, DestroyResponse)).destroyed
