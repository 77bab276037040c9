"""The edge: one daemon per node that runs the node's backends.

It serves ``dsec.edge.<node>.v1.*`` for the apiservers, heartbeats the node's capacity and
load into KV, and reconciles what really exists on the node with the cluster state: at start
and every ``reconcile_s`` it adopts sandboxes the cluster still knows, destroys ones it does
not (or that were reported lost), and reports lost the ones that are gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from nats.aio.client import Client as NATS

from dsec_kernel import __version__, bus
from dsec_kernel.config import EdgeSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, BackendContext, ExecCall, SandboxRef
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import (
    MAX_RESPONSE_OUTPUT,
    BackendInfo,
    CommandRecord,
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
    FsDiff,
    FsDiffRequest,
    LayerInfo,
    NodeInfo,
    NodeLoad,
    PauseReport,
    PauseRequest,
    PauseResponse,
    PrestageRequest,
    PrestageResponse,
    PublishRequest,
    ReadFileRequest,
    RestoreRequest,
    ResumeRequest,
    SandboxInfo,
    SnapshotInfo,
    SnapshotRequest,
    WriteFileRequest,
    fit_results,
    shell_argv,
)
from dsec_kernel.heartbeat import Heartbeat
from dsec_kernel.loader import PluginLoadError, configured, discover, load_drivers
from dsec_kernel.state import LIVE, ClusterState
from dsec_kernel.trajectory import Replays, Trajectory

__all__ = ["Edge", "load_backends"]

log = logging.getLogger(__name__)


def load_backends(settings: EdgeSettings) -> tuple[dict[str, Backend], dict[str, str]]:
    """Instantiate the node's backends; returns (backends, {skipped name: reason}).

    With ``settings.backends`` unset, every installed backend this machine can run is used and
    the others are skipped with their reason. A backend named explicitly that is missing,
    broken, misconfigured or cannot run here raises :class:`PluginLoadError`.
    """
    skipped: dict[str, str] = {}
    if settings.backends is None:
        classes = {}
        for p in discover("dsec.backends"):
            if p.error:
                skipped[p.name] = f"plugin does not load: {p.error}"
            elif not p.obj.default_enabled:
                skipped[p.name] = "runs only when named in --backends / DSEC_BACKENDS"
            else:
                classes[p.name] = p.obj
    else:
        classes = {n: p.obj for n, p in load_drivers("dsec.backends", settings.backends).items()}
    backends: dict[str, Backend] = {}
    for name, cls in classes.items():
        reason = cls.unavailable_reason()
        if reason:
            if settings.backends is not None:
                raise PluginLoadError(f"backend {name!r} cannot run on this machine: {reason}")
            skipped[name] = reason
            continue
        backends[name] = cls(configured("backend", name, cls, settings.backend_config.get(name)))
    installed = {p.name for p in discover("dsec.backends")}
    unknown = set(settings.backend_config) - installed
    if unknown:
        raise PluginLoadError(
            f"configuration given for backend(s) no installed plugin has: {sorted(unknown)}; "
            "`dsec plugins` lists them"
        )
    for name in sorted(set(settings.backend_config) & installed - set(classes)):
        log.info("configuration for backend %s is unused: it does not run here", name)
    return backends, skipped


def _mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


class Edge:
    """One node's edge. ``await start()``, then it serves until ``await stop()``."""

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
        self.edge_id = uuid.uuid4().hex
        self.sandboxes: dict[str, SandboxInfo] = {}
        self._counts: Counter[str] = Counter()
        self._born: dict[str, float] = {}  # sandbox id -> when this edge created it (monotonic)
        self._creating: set[str] = set()  # ids whose backend create is under way
        self._doomed: set[str] = set()  # of those, ids destroyed meanwhile
        self.paused: dict[str, str] = {}  # sandbox id -> why (a PAUSE_REASONS value)
        self._reclaimed: dict[str, int] = {}  # paused sandbox id -> bytes its pause gave back
        self._busy: Counter[str] = Counter()  # sandbox id -> commands running in it
        self._used: dict[str, float] = {}  # sandbox id -> last command's end (monotonic)
        self._layers: OrderedDict[str, None] = OrderedDict()  # layers used here, newest last
        self._rounds = 0  # reconciliations so far
        self._backend_infos = [
            BackendInfo(name=n, version=_plugin_version(b), capabilities=b.capabilities)
            for n, b in backends.items()
        ]
        self.running_execs = 0
        self.started_at = time.time()
        self.state: ClusterState | None = None
        self._drain: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._create_slots = {n: asyncio.Semaphore(settings.create_concurrency) for n in backends}
        self._started_backends: list[Backend] = []
        self._reporting: set[asyncio.Task[None]] = set()  # lost sandboxes being reported
        s = settings
        self._connect = connect or (
            lambda: bus.connect_service(
                s.nats_url, f"dsec-edge-{self.node}-heartbeat", s.nats_login_file,
                s.nats_credentials,
            )
        )  # fmt: skip
        self.heartbeat: Heartbeat | None = None  # the thread that says the node lives

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.state = await ClusterState.open(self.nc, replicas=self.settings.kv_replicas)
        self.trajectory = Trajectory(
            self.state.js, self.settings.kv_replicas, self.settings.trajectory_mb_per_tenant
        )
        self.replays = Replays(self.trajectory)
        for name, backend in self.backends.items():
            self.hooks.register(backend)
            state_dir = self.settings.state_dir / "backends" / name
            state_dir.mkdir(parents=True, exist_ok=True)
            try:
                await backend.start(BackendContext(self.node, state_dir, self.hooks, self._lost))
            except Exception as exc:
                await self._close_backends()
                raise PluginLoadError(f"backend {name!r} failed to start: {exc}") from exc
            self._started_backends.append(backend)
        self.hooks.configure("edge", self.node)
        await self.reconcile(full=True)
        self.heartbeat = Heartbeat(self._connect, self.settings.heartbeat_s, self.node_info())
        await asyncio.to_thread(self.heartbeat.start)
        ops = {
            "create": self._create,
            "destroy": self._destroy,
            "exec": self._exec,
            "fncall": self._fncall,
            "file.read": self._read_file,
            "file.write": self._write_file,
            "snapshot": self._snapshot,
            "restore": self._restore,
            "fs_diff": self._fs_diff,
            "publish": self._publish,
            "pause": self._pause,
            "resume": self._resume,
            "prestage": self._prestage,
        }
        _, self._drain = await bus.serve(
            self.nc,
            name="dsec-edge",
            version=__version__,
            description=f"DSec edge of node {self.node}",
            queue_group="edge",
            endpoints={bus.edge_subject(self.node, op): h for op, h in ops.items()},
        )
        self._tasks = [
            asyncio.create_task(self._every(self.settings.heartbeat_s, self._heartbeat)),
            asyncio.create_task(self._every(self.settings.reconcile_s, self.reconcile)),
            asyncio.create_task(self._every(self.settings.idle_check_s, self.pause_idle)),
        ]
        log.info("edge %s serving backends %s", self.node, ", ".join(self.backends))

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

    async def _announce_stop(self) -> None:
        """Tell the apiservers this edge stopped on purpose: its sandboxes stay, and the node
        is not marked down (nor they lost) unless it stays away past their restart grace."""
        if self.heartbeat is None:
            return
        info = self.node_info().model_copy(update={"stopping_since": time.time()})
        await asyncio.to_thread(self.heartbeat.stop, info)  # its last record
        self.heartbeat = None

    async def _close_backends(self) -> None:
        for backend in reversed(self._started_backends):
            try:
                await backend.close()
            except Exception:
                log.exception("closing backend %s failed", backend.name)
        self._started_backends.clear()

    async def _every(self, interval: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

    # -- heartbeat and reconciliation --------------------------------------------------------

    def _add(self, info: SandboxInfo) -> None:
        if info.id not in self.sandboxes:
            self._counts[info.backend] += 1
        self.sandboxes[info.id] = info

    def _remove(self, sandbox_id: str) -> None:
        self._born.pop(sandbox_id, None)
        self.paused.pop(sandbox_id, None)
        self._reclaimed.pop(sandbox_id, None)
        self._used.pop(sandbox_id, None)
        info = self.sandboxes.pop(sandbox_id, None)
        if info is not None:
            self._counts[info.backend] -= 1

    def _used_layers(self, refs: list[str]) -> None:
        """Remember layers used on this node (placement prefers nodes that have them)."""
        for ref in refs:
            self._layers[ref] = None
            self._layers.move_to_end(ref)
        while len(self._layers) > 256:
            self._layers.popitem(last=False)

    def node_info(self) -> NodeInfo:
        cpus = os.cpu_count() or 1
        return NodeInfo(
            node=self.node,
            edge_id=self.edge_id,
            pool=self.settings.pool,
            layers=list(self._layers),
            backends=self._backend_infos,
            cpus=cpus,
            memory_mb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20,
            load=NodeLoad(
                sandboxes=len(self.sandboxes),
                paused=len(self.paused),
                reclaimed_mb=sum(self._reclaimed.values()) >> 20,
                paused_by_backend=dict(
                    Counter(self.sandboxes[i].backend for i in self.paused if i in self.sandboxes)
                ),
                by_backend=dict(self._counts),
                running_execs=self.running_execs,
                cpu_load=os.getloadavg()[0] / cpus,
                mem_available_mb=_mem_available_mb(),
            ),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            heartbeat_s=self.settings.heartbeat_s,
            version=__version__,
        )

    async def _heartbeat(self) -> None:
        """Give the heartbeat thread the node's record as of now (it writes it)."""
        if self.heartbeat is not None:
            self.heartbeat.update(self.node_info())

    async def reconcile(self, full: bool = False) -> None:
        """Make the node and the cluster state agree (see the module docstring). ``full``
        (at start) reads every record to find this node's. Later rounds read records by
        key: those of sandboxes the node has but does not know or knows but no longer has,
        and every tenth round those of all it has (a record reported lost or deleted
        elsewhere) — so a round's cost does not grow with the cluster."""
        assert self.state is not None
        had = set(self.sandboxes)
        present: dict[str, str] = {}
        for name, backend in self.backends.items():
            for sid in await backend.list_sandboxes():
                present[sid] = name
        self._rounds += 1
        checked: set[str] | None = None  # None: every record was read
        if full:
            records = await self.state.scan_sandboxes(self.node)
        else:
            check = [*present, *self.sandboxes]
            if self._rounds % 10:
                check = [i for i in check if (i in present) != (i in self.sandboxes)]
            checked = set(check)
            known = await self.state.get_sandboxes(check)
            records = {k: v for k, v in known.items() if v[0].node == self.node}
        young = time.monotonic() - 30.0  # created here so lately its record may still be coming
        for sid, name in present.items():
            if checked is not None and sid not in checked:
                continue  # known and present: its record is read every tenth round
            rec = records.get(sid)
            if rec is not None and rec[0].state in LIVE:
                if sid not in self.sandboxes:
                    self._add(rec[0])
                    if rec[0].state == "paused":
                        self.paused[sid] = rec[0].paused_reason or "requested"
                continue
            local = self.sandboxes.get(sid)
            if rec is None and self._born.get(sid, -1.0) > young:
                continue
            if sid in had and local is None:
                continue  # destroyed while this round read the records
            info = rec[0] if rec else local
            log.warning("reconcile: destroying %s (%s)", sid, "lost" if rec else "unknown")
            await self._destroy_one(sid, name, info, "reconcile")
        for sid, (info, rev) in records.items():
            if sid not in present and info.state in LIVE:
                self._remove(sid)
                with suppress(errors.Conflict):
                    await self.state.cas_sandbox(info.model_copy(update={"state": "lost"}), rev)
                log.warning("reconcile: %s is gone from this node; reported lost", sid)

    # -- handlers ----------------------------------------------------------------------------

    def _backend(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            raise errors.UnknownBackend(f"node {self.node} does not run backend {name!r}") from None

    def _sandbox(self, sandbox_id: str) -> tuple[SandboxInfo, Backend]:
        info = self.sandboxes.get(sandbox_id)
        if info is None:
            raise errors.NotFound(f"sandbox {sandbox_id} is not on node {self.node}")
        return info, self.backends[info.backend]

    async def _create(self, req: bus.Request) -> EdgeCreateResponse:
        r = EdgeCreateRequest.model_validate_json(req.data)
        results = await asyncio.gather(*(self._create_one(sb) for sb in r.sandboxes))
        out = EdgeCreateResponse(completed_at=time.time())
        for sb, res in zip(r.sandboxes, results, strict=True):
            if isinstance(res, SandboxInfo):
                out.created.append(res)
            else:
                out.failed.append(Failure(id=sb.id, error=Error.of(res)))
        return out

    async def _create_one(self, sb: EdgeSandbox) -> SandboxInfo | errors.DsecError:
        if sb.id in self.sandboxes:
            return self.sandboxes[sb.id]
        self._creating.add(sb.id)
        try:
            backend = self._backend(sb.spec.backend)
            async with self._create_slots[sb.spec.backend]:
                status = await backend.create(sb)
        except errors.DsecError as exc:
            return exc
        except Exception:
            log.exception("creating %s failed", sb.id)
            return errors.Internal(f"creating {sb.id} on {self.node} failed")
        finally:
            self._creating.discard(sb.id)
            doomed = sb.id in self._doomed
            self._doomed.discard(sb.id)
        if doomed:  # its creator gave up on it (a timeout) and destroyed it meanwhile
            await backend.destroy(SandboxRef(sandbox_id=sb.id))
            return errors.Conflict(f"sandbox {sb.id} was destroyed while it was being made")
        info = SandboxInfo(
            id=sb.id,
            tenant=sb.tenant,
            backend=sb.spec.backend,
            node=self.node,
            created_at=sb.created_at,
            expires_at=sb.expires_at,
            labels=sb.spec.labels,
            job=sb.spec.job,
            idle_ttl_s=sb.spec.idle_ttl_s,
            spec=sb.spec,
        )
        self._add(info)
        self._born[sb.id] = time.monotonic()
        self.replays.fresh(sb.id)
        self._used_layers(status.layers)
        await self.hooks.sandbox_created(info)
        return info

    async def _destroy(self, req: bus.Request) -> DestroyResponse:
        r = DestroyRequest.model_validate_json(req.data)
        out = DestroyResponse()
        found = [(i, self.sandboxes.get(i)) for i in r.ids]
        await asyncio.gather(
            *(self._destroy_one(i, info.backend, info, "requested") for i, info in found if info)
        )
        # ids this edge does not know may still hold something in a backend (one lost while
        # its report was on its way, say): every backend's destroy is idempotent
        unknown = [i for i, info in found if info is None]
        self._doomed.update(i for i in unknown if i in self._creating)  # destroyed once made
        await asyncio.gather(
            *(b.destroy(SandboxRef(sandbox_id=i)) for i in unknown for b in self.backends.values())
        )
        for i, info in found:
            (out.destroyed if info else out.not_found).append(i)
        return out

    async def _destroy_one(
        self, sandbox_id: str, backend: str, info: SandboxInfo | None, reason: str
    ) -> None:
        await self.backends[backend].destroy(SandboxRef(sandbox_id=sandbox_id))
        self._remove(sandbox_id)
        self.replays.forget(sandbox_id)
        if info is not None:
            await self.hooks.sandbox_destroyed(info, reason)

    def _lost(self, sandbox_id: str, reason: str) -> None:
        """BackendContext.lost: a backend saw a sandbox end by itself."""
        task = asyncio.get_running_loop().create_task(self._report_lost(sandbox_id, reason))
        self._reporting.add(task)
        task.add_done_callback(self._reporting.discard)

    async def _report_lost(self, sandbox_id: str, reason: str) -> None:
        """Record the sandbox lost at once, then destroy it, so that what it held (files,
        cgroups, layer holds) is released now rather than when its tenant destroys it."""
        info = self.sandboxes.get(sandbox_id)
        if info is None:
            return
        log.warning("sandbox %s is lost: %s", sandbox_id, reason)
        self._remove(sandbox_id)
        self.replays.forget(sandbox_id)
        assert self.state is not None
        try:
            await self.state.set_sandbox_state(sandbox_id, "lost")
        except errors.DsecError as exc:  # reconciliation reports it later
            log.warning("could not record %s lost: %s", sandbox_id, exc)
        try:
            await self.backends[info.backend].destroy(SandboxRef(sandbox_id=sandbox_id))
        except Exception:
            log.exception("destroying lost sandbox %s failed", sandbox_id)
        await self.hooks.guard_event(sandbox_id, "sandbox_lost", {"reason": reason})
        await self.hooks.sandbox_destroyed(info, "lost")

    async def _exec(self, req: bus.Request) -> ExecResponse:
        r = ExecRequest.model_validate_json(req.data)
        # what the answer can carry is shared out before the commands run, not after: 150
        # commands printing 8 MiB each were held whole (2.9 GB) to send back 12 MB
        share = MAX_RESPONSE_OUTPUT // (2 * len(r.sandbox_ids))
        if r.max_output_bytes > share:
            r = r.model_copy(update={"max_output_bytes": max(share, 4096)})
        results = await asyncio.gather(*(self._exec_one(r, sid) for sid in r.sandbox_ids))
        return ExecResponse(results=fit_results(list(results)))

    async def _exec_one(self, r: ExecRequest, sandbox_id: str) -> ExecResult:
        """Run the command, log it in the sandbox's trajectory, answer; a request id that
        already ran there gets the logged result."""
        rid = r.request_id
        self._busy[sandbox_id] += 1  # from before the paused check: no pause slips in
        ran = mine = False
        result: ExecResult | None = None
        try:
            info, backend = await self._awake(sandbox_id)
            if rid:
                seen = await self.replays.lookup(info.tenant, sandbox_id, rid)
                if seen is not None:
                    return await asyncio.shield(seen)
                self.replays.begin(sandbox_id, rid)
                mine = True
            reason = await self.hooks.guard_exec(info, r)
            if reason:
                raise errors.Forbidden(f"refused by a guard: {reason}")
            call = ExecCall(
                sandbox_id=sandbox_id,
                argv=shell_argv(r.command),
                timeout_s=r.timeout_s,
                env=r.env,
                cwd=r.cwd,
                user=r.user,
                stdin=r.stdin,
                max_output_bytes=r.max_output_bytes,
                tenant=info.tenant,
            )
            self.running_execs += 1
            started = time.time()
            try:
                result = await backend.exec(call)
            finally:
                self.running_execs -= 1
            ran = True
            await self._log(info, r, call, started, result)
        except errors.DsecError as exc:
            result = ExecResult(sandbox_id=sandbox_id, exit_code=-1, error=Error.of(exc))
        finally:
            self._busy[sandbox_id] -= 1
            if self._busy[sandbox_id] <= 0:
                del self._busy[sandbox_id]
            if sandbox_id in self.sandboxes:
                self._used[sandbox_id] = time.monotonic()
            if mine:
                assert rid is not None
                gone = errors.Unavailable("the command was cut short; send it again")
                fallback = ExecResult(sandbox_id=sandbox_id, exit_code=-1, error=Error.of(gone))
                self.replays.end(sandbox_id, rid, result or fallback, ran)
        if ran:
            await self._report(sandbox_id, result)
        return result

    async def _log(
        self, info: SandboxInfo, r: ExecRequest, call: ExecCall, started: float, result: ExecResult
    ) -> None:
        cap = self.settings.trajectory_output_bytes
        rec = CommandRecord(
            request_id=r.request_id, argv=call.argv, env=r.env, cwd=r.cwd, user=r.user,
            timeout_s=r.timeout_s, stdin=r.stdin[:cap], started_at=started,
            duration_s=result.duration_s, exit_code=result.exit_code,
            timed_out=result.timed_out, truncated=result.truncated,
            stdout=result.stdout[:cap], stderr=result.stderr[:cap],
            stdout_bytes=len(result.stdout), stderr_bytes=len(result.stderr),
        )  # fmt: skip
        await self._append(info, rec)

    async def _append(self, info: SandboxInfo, rec: CommandRecord) -> None:
        """Add to the sandbox's trajectory; a failure is logged, the work done still
        answered."""
        try:
            await self.trajectory.append(info.tenant, info.id, rec)
        except Exception as exc:
            log.warning("could not log a %s of %s in its trajectory: %s", rec.kind, info.id, exc)

    async def _report(self, sandbox_id: str, result: ExecResult) -> None:
        if result.timed_out:
            await self.hooks.guard_event(sandbox_id, "timeout", {"duration_s": result.duration_s})
        if result.truncated:
            await self.hooks.guard_event(sandbox_id, "output_flood", {})

    async def _fncall(self, req: bus.Request) -> ExecResult:
        r = FncallRequest.model_validate_json(req.data)
        if r.sandbox_id:
            _, backend = self._sandbox(r.sandbox_id)
        else:
            backend = next(
                (
                    b
                    for b in self.backends.values()
                    if r.language in b.capabilities.fncall_languages
                ),
                None,
            )
            if backend is None:
                raise errors.Unsupported(f"no backend on {self.node} serves {r.language!r} calls")
        self.running_execs += 1
        try:
            result = await backend.fncall(r)
        finally:
            self.running_execs -= 1
        await self._report(r.sandbox_id or "", result)
        return result

    async def _read_file(self, req: bus.Request):
        r = ReadFileRequest.model_validate_json(req.data)
        return await self._sandbox(r.sandbox_id)[1].read_file(r)  # paused or not

    async def _write_file(self, req: bus.Request):
        r = WriteFileRequest.model_validate_json(req.data)
        return await self._sandbox(r.sandbox_id)[1].write_file(r)  # paused or not

    async def _snapshot(self, req: bus.Request) -> SnapshotInfo:
        r = SnapshotRequest.model_validate_json(req.data)
        info, backend = self._sandbox(r.sandbox_id)
        snap = await backend.snapshot(r)
        await self._mark(info, "snapshot", snap.id)
        return snap

    async def _restore(self, req: bus.Request) -> SandboxInfo:
        r = RestoreRequest.model_validate_json(req.data)
        info, backend = await self._awake(r.sandbox_id)
        await backend.restore(r)
        await self._mark(info, "restore", r.snapshot_id)
        return info

    async def _mark(self, info: SandboxInfo, kind: str, snapshot_id: str | None) -> None:
        """Log a snapshot or restore in the trajectory (a replay starts from the last one)."""
        await self._append(info, CommandRecord(kind=kind, started_at=time.time(),
                                               snapshot_id=snapshot_id))  # fmt: skip

    async def _fs_diff(self, req: bus.Request) -> FsDiff:
        r = FsDiffRequest.model_validate_json(req.data)
        return await self._sandbox(r.sandbox_id)[1].fs_diff(r)

    # -- pause and resume --------------------------------------------------------------------

    async def _awake(self, sandbox_id: str) -> tuple[SandboxInfo, Backend]:
        """The sandbox, for work: one paused for being idle is resumed first; one paused for
        another reason raises SandboxPaused."""
        info, backend = self._sandbox(sandbox_id)
        why = self.paused.get(sandbox_id)
        if why == "idle":
            await self._resume_one(sandbox_id, None)
        elif why is not None:
            what = {"lease": "renew its job's lease", "priority": "wait, or resume() it"}
            raise errors.SandboxPaused(
                f"sandbox {sandbox_id} is paused ({why}): {what.get(why, 'resume() it')} first"
            )
        self._used[sandbox_id] = time.monotonic()
        return info, backend

    async def _pause(self, req: bus.Request) -> PauseResponse:
        r = PauseRequest.model_validate_json(req.data)
        results = await asyncio.gather(
            *(self._pause_one(i, r.reason) for i in r.ids), return_exceptions=True
        )
        return _power_response(r.ids, results)

    async def _resume(self, req: bus.Request) -> PauseResponse:
        r = ResumeRequest.model_validate_json(req.data)
        results = await asyncio.gather(
            *(self._resume_one(i, r.reason) for i in r.ids), return_exceptions=True
        )
        return _power_response(r.ids, results)

    async def _pause_one(self, sandbox_id: str, reason: str) -> PauseReport:
        info, backend = self._sandbox(sandbox_id)
        if not backend.capabilities.pause:
            raise errors.Unsupported(f"the {info.backend} backend cannot pause")
        if sandbox_id in self.paused:
            if self.paused[sandbox_id] == "idle":  # a stronger reason replaces idleness
                self.paused[sandbox_id] = reason
                await self._record(sandbox_id, "paused", reason)
            return PauseReport(sandbox_id=sandbox_id, state="paused")
        if self._busy[sandbox_id]:
            raise errors.Conflict(
                f"a command is running in {sandbox_id}; pause it when the command ends"
            )
        self.paused[sandbox_id] = reason  # from here on, new work waits or is refused
        try:
            report = await backend.pause(SandboxRef(sandbox_id=sandbox_id))
        except BaseException:
            self.paused.pop(sandbox_id, None)
            raise
        self._reclaimed[sandbox_id] = max(0, report.memory_before_bytes - report.memory_after_bytes)
        await self._record(sandbox_id, "paused", reason)
        return report

    async def _resume_one(self, sandbox_id: str, reason: str | None) -> PauseReport:
        _, backend = self._sandbox(sandbox_id)
        why = self.paused.get(sandbox_id)
        if why is None:
            return PauseReport(sandbox_id=sandbox_id, state="ready")
        if reason is not None and why != reason:
            return PauseReport(sandbox_id=sandbox_id, state="paused")
        report = await backend.resume(SandboxRef(sandbox_id=sandbox_id))
        self.paused.pop(sandbox_id, None)
        self._reclaimed.pop(sandbox_id, None)
        self._used[sandbox_id] = time.monotonic()
        await self._record(sandbox_id, "ready", None)
        return report

    async def _record(self, sandbox_id: str, state: str, reason: str | None) -> None:
        assert self.state is not None
        info = await self.state.set_sandbox_state(sandbox_id, state, reason)
        if info is not None and sandbox_id in self.sandboxes:
            self.sandboxes[sandbox_id] = info

    async def pause_idle(self) -> None:
        """Pause sandboxes that ran no command for their ``idle_ttl_s``."""
        now = time.monotonic()
        for sid, info in list(self.sandboxes.items()):
            ttl = info.idle_ttl_s
            if ttl is None or sid in self.paused or self._busy[sid]:
                continue
            last = self._used.setdefault(sid, now)
            if now - last >= ttl and self.backends[info.backend].capabilities.pause:
                try:
                    await self._pause_one(sid, "idle")
                    log.info("paused %s: idle for %.0f s", sid, now - last)
                except errors.DsecError as exc:
                    log.warning("could not pause idle %s: %s", sid, exc)

    async def _prestage(self, req: bus.Request) -> PrestageResponse:
        r = PrestageRequest.model_validate_json(req.data)
        staged: list[str] = []
        for backend in self.backends.values():
            staged += await backend.prestage(list(r.layers), r.tenant)
        if not staged:
            raise errors.Unsupported(f"no backend on {self.node} uses layers")
        self._used_layers(staged)
        return PrestageResponse(nodes=[self.node])

    async def _publish(self, req: bus.Request) -> LayerInfo:
        r = PublishRequest.model_validate_json(req.data)
        backend = next((b for b in self.backends.values() if b.capabilities.snapshot), None)
        if backend is None:
            raise errors.Unsupported(f"no backend on {self.node} keeps snapshots")
        return await backend.publish(r)


def _power_response(ids: list[str], results: list[Any]) -> PauseResponse:
    out = PauseResponse()
    for sid, res in zip(ids, results, strict=True):
        if isinstance(res, PauseReport):
            out.done.append(res)
        elif isinstance(res, errors.DsecError):
            out.failed.append(Failure(id=sid, error=Error.of(res)))
        else:
            log.error("pause/resume of %s failed", sid, exc_info=res)
            err = errors.Internal(f"pause/resume of {sid} failed; the edge's log says why")
            out.failed.append(Failure(id=sid, error=Error.of(err)))
    return out


def _plugin_version(backend: Backend) -> str:
    from importlib import metadata

    module = type(backend).__module__.split(".")[0]
    try:
        return metadata.version(metadata.packages_distributions().get(module, [module])[0])
    except (metadata.PackageNotFoundError, IndexError):
        return ""
