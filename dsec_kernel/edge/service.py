"""The edge: one daemon per node that runs the node's backends.

It serves ``dsec.edge.<node>.v1.*`` for the apiservers, heartbeats the node's capacity and
load into KV, and reconciles what really exists on the node with the cluster state: at start
and every ``reconcile_s`` it adopts sandboxes the cluster still knows, destroys ones it does
not (or that were reported lost), and reports lost the ones that are gone.

:class:`Edge` composes the parts, each given only what it uses: the sandbox table
(:mod:`.table`), the node's record (:mod:`.node`) and its heartbeat thread (:mod:`.heartbeat`),
creation and destruction (:mod:`.lifecycle`), commands (:mod:`.commands`), files and
snapshots (:mod:`.files`), pause and resume (:mod:`.power`), the trajectory (:mod:`.history`)
and reconciliation (:mod:`.reconcile`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from nats.aio.client import Client as NATS

from dsec_kernel import __version__, bus
from dsec_kernel.config import EdgeSettings
from dsec_kernel.contract.backend import Backend, BackendContext
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import (
    DestroyRequest,
    EdgeCreateRequest,
    ExecRequest,
    FncallRequest,
    FsDiffRequest,
    NodeInfo,
    PauseRequest,
    PrestageRequest,
    PublishRequest,
    ReadFileRequest,
    RestoreRequest,
    ResumeRequest,
    SnapshotRequest,
    WriteFileRequest,
)
from dsec_kernel.edge.commands import Commands
from dsec_kernel.edge.files import Files
from dsec_kernel.edge.heartbeat import Heartbeat
from dsec_kernel.edge.history import History
from dsec_kernel.edge.lifecycle import Lifecycle
from dsec_kernel.edge.node import NodeReport, RecentLayers
from dsec_kernel.edge.power import Power
from dsec_kernel.edge.reconcile import Reconciler
from dsec_kernel.edge.table import SandboxTable
from dsec_kernel.loader import PluginLoadError
from dsec_kernel.state.facade import ClusterState
from dsec_kernel.trajectory import Replays, Trajectory

__all__ = ["Edge"]

log = logging.getLogger(__name__)


class Edge:
    """One node's edge. ``await start()``, then it serves until ``await stop()``.

    ``sandboxes`` is the table of the sandboxes on the node; the parts that serve requests
    are made by :meth:`start`, once the cluster state is open.
    """

    lifecycle: Lifecycle
    commands: Commands
    power: Power
    reconciler: Reconciler

    def __init__(
        self,
        nc: NATS,
        settings: EdgeSettings,
        backends: dict[str, Backend],
        hooks: Hooks,
        connect: Callable[[], Awaitable[NATS]] | None = None,
    ) -> None:
        """``connect`` opens the heartbeat's own connection (by default, as ``settings`` say)."""
        if not backends:
            raise PluginLoadError("no backend can run on this node; `dsec plugins` says why")
        self.nc = nc
        self.settings = settings
        self.node = settings.node
        self.backends = backends
        self.hooks = hooks
        self.sandboxes = SandboxTable(self.node)
        self.layers = RecentLayers()
        self.report = NodeReport(
            self.node, settings.pool, settings.heartbeat_s, backends, self.sandboxes, self.layers
        )
        s = settings
        self._connect = connect or (
            lambda: bus.connect_service(
                s.nats_url, f"dsec-edge-{self.node}-heartbeat", s.nats_login_file,
                s.nats_credentials,
            )
        )  # fmt: skip
        self.heartbeat: Heartbeat | None = None  # the thread that says the node lives
        self._drain: Callable[[], Awaitable[None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started_backends: list[Backend] = []
        self._reporting: set[asyncio.Task[None]] = set()  # lost sandboxes being reported

    # -- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        state = await ClusterState.open(self.nc, replicas=s.kv_replicas)
        trajectory = Trajectory(state.js, s.kv_replicas, s.trajectory_mb_per_tenant)
        replays = Replays(trajectory)
        history = History(trajectory, s.trajectory_output_bytes)
        table, backends, node = self.sandboxes, self.backends, self.node
        self.power = Power(table, state)
        self.lifecycle = Lifecycle(
            node, backends, table, state, self.hooks, replays, self.layers, s.create_concurrency
        )
        self.commands = Commands(
            node, backends, table, self.power.awake, replays, history, self.hooks
        )
        files = Files(node, backends, table, self.power.awake, history, self.layers)
        self.reconciler = Reconciler(node, backends, table, state, self.lifecycle.destroy_one)
        await self._start_backends()
        self.hooks.configure("edge", node)
        await self.reconcile(full=True)
        self.heartbeat = Heartbeat(self._connect, s.heartbeat_s, self._node_info())
        await asyncio.to_thread(self.heartbeat.start)
        # the bus parses each request into its model and maps what a handler raises
        endpoints = {
            "create": bus.Endpoint(self.lifecycle.create, request=EdgeCreateRequest),
            "destroy": bus.Endpoint(self.lifecycle.destroy, request=DestroyRequest),
            "exec": bus.Endpoint(self.commands.exec, request=ExecRequest),
            "fncall": bus.Endpoint(self.commands.fncall, request=FncallRequest),
            "file.read": bus.Endpoint(files.read_file, request=ReadFileRequest),
            "file.write": bus.Endpoint(files.write_file, request=WriteFileRequest),
            "snapshot": bus.Endpoint(files.snapshot, request=SnapshotRequest),
            "restore": bus.Endpoint(files.restore, request=RestoreRequest),
            "fs_diff": bus.Endpoint(files.fs_diff, request=FsDiffRequest),
            "publish": bus.Endpoint(files.publish, request=PublishRequest),
            "pause": bus.Endpoint(self.power.pause, request=PauseRequest),
            "resume": bus.Endpoint(self.power.resume, request=ResumeRequest),
            "prestage": bus.Endpoint(files.prestage, request=PrestageRequest),
        }
        _, self._drain = await bus.serve(
            self.nc,
            name="dsec-edge",
            version=__version__,
            description=f"DSec edge of node {node}",
            queue_group="edge",
            endpoints={bus.edge_subject(node, op): e for op, e in endpoints.items()},
        )
        self._tasks = [
            asyncio.create_task(self._every(s.heartbeat_s, self._heartbeat)),
            asyncio.create_task(self._every(s.reconcile_s, self.reconcile)),
            asyncio.create_task(self._every(s.idle_check_s, self.power.pause_idle)),
        ]
        log.info("edge %s serving backends %s", node, ", ".join(backends))

    async def stop(self) -> None:
        """Stop serving and heartbeating, then close the backends. Sandboxes stay for a restart."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with suppress(asyncio.CancelledError):
                await t
        if self._drain is not None:
            await self._drain()
        if self._reporting:
            await asyncio.wait(set(self._reporting), timeout=10)
        await self._announce_stop()
        await self._close_backends()

    async def reconcile(self, full: bool = False) -> None:
        """One reconciliation (see :meth:`Reconciler.run`)."""
        await self.reconciler.run(full)

    async def _start_backends(self) -> None:
        for name, backend in self.backends.items():
            self.hooks.register(backend)
            state_dir = self.settings.state_dir / "backends" / name
            state_dir.mkdir(parents=True, exist_ok=True)
            ctx = BackendContext(self.node, state_dir, self.hooks, self._lost)
            try:
                await backend.start(ctx)
            except Exception as exc:
                await self._close_backends()
                raise PluginLoadError(f"backend {name!r} failed to start: {exc}") from exc
            self._started_backends.append(backend)

    async def _announce_stop(self) -> None:
        """Tell the apiservers this edge stopped on purpose: its sandboxes stay, and the node
        is not marked down (nor they lost) unless it stays away past their restart grace."""
        if self.heartbeat is None:
            return
        info = self._node_info().model_copy(update={"stopping_since": time.time()})
        await asyncio.to_thread(self.heartbeat.stop, info)  # its last record
        self.heartbeat = None

    async def _close_backends(self) -> None:
        for backend in reversed(self._started_backends):
            try:
                await backend.close()
            except Exception:
                log.exception("closing backend %s failed", backend.name)
        self._started_backends.clear()

    def _lost(self, sandbox_id: str, reason: str) -> None:
        """BackendContext.lost: a backend saw a sandbox end by itself."""
        report = self.lifecycle.report_lost(sandbox_id, reason)
        task = asyncio.get_running_loop().create_task(report)
        self._reporting.add(task)
        task.add_done_callback(self._reporting.discard)

    # -- heartbeat ---------------------------------------------------------------------------

    def _node_info(self) -> NodeInfo:
        return self.report.info(self.commands.running)

    async def _heartbeat(self) -> None:
        """Give the heartbeat thread the node's record as of now (it writes it)."""
        if self.heartbeat is not None:
            self.heartbeat.update(self._node_info())

    async def _every(self, interval: float, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))
