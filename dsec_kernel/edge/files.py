"""A sandbox's files and their snapshots, and the layers the node's backends keep."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend
from dsec_kernel.contract.wire import (
    FsDiff,
    FsDiffRequest,
    LayerInfo,
    PrestageRequest,
    PrestageResponse,
    PublishRequest,
    ReadFileRequest,
    ReadFileResponse,
    RestoreRequest,
    SandboxInfo,
    SnapshotInfo,
    SnapshotRequest,
    WriteFileRequest,
    WriteFileResponse,
)
from dsec_kernel.edge.history import History
from dsec_kernel.edge.node import RecentLayers
from dsec_kernel.edge.table import SandboxRecord, SandboxTable

__all__ = ["Files"]


class Files:
    """Reads, writes, diffs, snapshots and restores sandboxes' files (a paused sandbox's
    too, but a restore wakes it: ``awake``), publishes snapshots as layers and prestages
    layers; snapshots and restores go into the trajectory."""

    def __init__(
        self,
        node: str,
        backends: dict[str, Backend],
        table: SandboxTable,
        awake: Callable[[SandboxRecord], Awaitable[None]],
        history: History,
        layers: RecentLayers,
    ) -> None:
        self.node = node
        self.backends = backends
        self.table = table
        self.awake = awake
        self.history = history
        self.layers = layers

    async def read_file(self, r: ReadFileRequest, call: bus.Call) -> ReadFileResponse:
        return await self.table.require(r.sandbox_id).backend.read_file(r)

    async def write_file(self, r: WriteFileRequest, call: bus.Call) -> WriteFileResponse:
        return await self.table.require(r.sandbox_id).backend.write_file(r)

    async def fs_diff(self, r: FsDiffRequest, call: bus.Call) -> FsDiff:
        return await self.table.require(r.sandbox_id).backend.fs_diff(r)

    async def snapshot(self, r: SnapshotRequest, call: bus.Call) -> SnapshotInfo:
        rec = self.table.require(r.sandbox_id)
        snap = await rec.backend.snapshot(r)
        await self.history.mark(rec.info, "snapshot", snap.id)
        return snap

    async def restore(self, r: RestoreRequest, call: bus.Call) -> SandboxInfo:
        rec = self.table.require(r.sandbox_id)
        await self.awake(rec)
        info = rec.info
        await rec.backend.restore(r)
        await self.history.mark(info, "restore", r.snapshot_id)
        return info

    async def publish(self, r: PublishRequest, call: bus.Call) -> LayerInfo:
        backend = next((b for b in self.backends.values() if b.capabilities.snapshot), None)
        if backend is None:
            raise errors.Unsupported(f"no backend on {self.node} keeps snapshots")
        return await backend.publish(r)

    async def prestage(self, r: PrestageRequest, call: bus.Call) -> PrestageResponse:
        staged: list[str] = []
        for backend in self.backends.values():
            staged += await backend.prestage(list(r.layers), r.tenant)
        if not staged:
            raise errors.Unsupported(f"no backend on {self.node} uses layers")
        self.layers.use(staged)
        return PrestageResponse(nodes=[self.node])
