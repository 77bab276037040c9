"""The container backend: a full Linux userland per sandbox, on shared read-only layers.

Each sandbox is one tiny native init (``csrc/dsec-sandbox.c``) that is PID 1 of its own PID,
mount, UTS, IPC and network namespaces, in a user namespace of its own: root in a sandbox is
an unprivileged host uid of a range no other sandbox has (:mod:`.userns`). Its root is an
overlay: the environment's EROFS layers (mounted once per node from the layer store) and its
snapshots' deltas below, a writable upper above on a btrfs subvolume with a disk quota
(:mod:`.upperfs`), all idmapped into its user namespace. cgroups (v1) give it a CPU quota
and shares, a memory and a process limit, and a freezer. Commands and file operations enter
it through the same helper, by the init's pidfd (:mod:`.inits`), as the sandbox's own users.
No Python process stays per sandbox; an idle one costs its init and kernel objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsec_backend_container.fsdiff import diff
from dsec_backend_container.helper import Helper, compiler
from dsec_backend_container.inits import Inits, exited, process_start
from dsec_backend_container.inodes import InodeLimits
from dsec_backend_container.lanes import Lanes, checkpoint
from dsec_backend_container.layout import Meta, SandboxDir, Trash, delete_tree
from dsec_backend_container.network import Egress
from dsec_backend_container.overlay import apply
from dsec_backend_container.reclaim import (
    ZramSwap,
    freeze,
    hierarchy_root,
    is_frozen,
    memory_charge,
    reclaim,
)
from dsec_backend_container.seccomp import write_profile
from dsec_backend_container.snapshots import Snapshots
from dsec_backend_container.upperfs import UpperFs
from dsec_backend_container.userns import UidRanges
from dsec_kernel import deadline
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import (
    Backend,
    BackendContext,
    Capabilities,
    ExecCall,
    PauseReport,
    SandboxRef,
    SandboxStatus,
)
from dsec_kernel.contract.store import LayerStore
from dsec_kernel.contract.wire import (
    MAX_FILE_BYTES,
    SANDBOX_ID_PATTERN,
    EdgeSandbox,
    ExecResult,
    FsDiff,
    FsDiffRequest,
    LayerInfo,
    Limits,
    PublishRequest,
    ReadFileRequest,
    ReadFileResponse,
    RestoreRequest,
    SnapshotInfo,
    SnapshotRequest,
    WriteFileRequest,
    WriteFileResponse,
)
from dsec_kernel.contract.wire.sandbox import LayerRef
from dsec_kernel.fairshare import TenantSlots
from dsec_kernel.linuxhost.cgroups import Group, favor_dynamic_changes, host_reserve, v1_controllers
from dsec_kernel.linuxhost.fileio import remove_tree
from dsec_kernel.loader import open_store

__all__ = ["ContainerBackend", "ContainerConfig"]

log = logging.getLogger(__name__)
_ID = re.compile(SANDBOX_ID_PATTERN)
#: names of trees being published, in the sandboxes' directory
_PUBLISHING = ".publish-"
#: most layers kept mounted ahead of use by prestage
PRESTAGED = 64
READS_FRESH_S = 5.0  # a layer's reads measured this recently are reported again as they were
CONTROLLERS = ("cpu", "memory", "pids", "freezer")
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}


# settings renamed since they were released: a node's environment outlives an upgrade
RENAMED = {"egress_bridge": "egress_name"}


class ContainerConfig(BaseModel):
    """``DSEC_BACKEND_CONFIG__CONTAINER__<FIELD>``; see the plugin's README. A setting's old
    name (:data:`RENAMED`) is taken as its new one, with a warning."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and RENAMED.keys() & data.keys():
            data = dict(data)
            for old, new in RENAMED.items():
                if old in data:
                    log.warning("container setting %s is now %s: taken as that", old, new)
                    value = data.pop(old)
                    data.setdefault(new, value)
        return data

    storage: str | None = Field(None, description="the dsec.storage driver (default DSEC_STORAGE)")
    storage_config: dict[str, Any] | None = Field(
        None, description="its configuration (default DSEC_STORAGE_CONFIG__*)"
    )
    max_sandboxes: int = Field(3200, ge=1)
    memory_mb: int = Field(2048, ge=16, description="default memory limit")
    pids: int = Field(1024, ge=8, description="default process limit")
    max_memory_mb: int | None = Field(
        None,
        ge=16,
        description="largest memory limit a sandbox may ask for (None: what all "
        "sandboxes may use together)",
    )
    max_pids: int = Field(16384, ge=8, description="largest process limit a sandbox may ask for")
    cpus: float | None = Field(None, gt=0, description="default CPU quota (None: shares only)")
    disk_mb: int = Field(10240, ge=16, description="default disk quota of a sandbox's files")
    max_disk_mb: int | None = Field(
        None, ge=16, description="largest disk quota a sandbox may ask for (None: tenant_disk_mb)"
    )
    tenant_disk_mb: int | None = Field(
        None,
        ge=16,
        description="most of the node's sandbox disk one tenant's sandboxes may fill together "
        "(None: half of it)",
    )
    inodes: int = Field(
        1_000_000, ge=64, description="default inode limit of a sandbox's writable layer"
    )
    max_inodes: int = Field(
        4_000_000, ge=64, description="largest inode limit a sandbox may ask for"
    )
    inode_check_s: float = Field(
        1.0, gt=0, description="how often sandboxes are held to their inode limits"
    )
    lanes: int = Field(
        4, ge=1, description="threads for long work tenants ask for (one per tenant at a time)"
    )
    file_ops: int = Field(
        32, ge=1, description="file operations in flight on the node (a tenant: 3/4 of them)"
    )
    file_waiting: int = Field(
        4096, ge=0, description="most file operations of one tenant waiting for a turn"
    )
    file_timeout_s: float = Field(30.0, gt=0, description="longest a file operation may take")
    upper_root: Path | None = Field(None, description="where writable layers go (local disk)")
    upper_fs_gb: float = Field(
        0,
        ge=0,
        description="size of the btrfs image made when upper_root is not on btrfs "
        "(0: nine tenths of the free space; sparse)",
    )
    hostname: str = "sandbox"
    snapshot_max_depth: int = Field(16, ge=2)
    snapshot_grace_s: float = Field(60.0, ge=0)
    gc_interval_s: float = Field(60.0, gt=0)
    pause_swap: Literal["zram", "none"] = Field(
        "zram", description="zram: make compressed swap for paused sandboxes if none exists"
    )
    zram_size_mb: int = Field(0, ge=0, description="its size (0: half the node's memory)")
    egress_subnet: str = Field("10.213.0.0/16", description="addresses of egress sandboxes")
    egress_name: str = Field(
        "dsec0", pattern=r"^[A-Za-z0-9_-]{1,15}$", description="names this backend's egress rules"
    )
    egress_allow: list[str] = Field(
        default_factory=list,
        description="CIDR [tcp|udp[/PORT[-PORT]]] egress sandboxes may reach although not "
        "global (e.g. the cluster's DNS resolver); never the host or another sandbox",
    )
    egress_deny: list[str] = Field(
        default_factory=list, description="more CIDRs egress sandboxes may not reach"
    )
    egress_max_flows: int = Field(4096, ge=1, description="connections one sandbox may track")
    egress_check_s: float = Field(
        2.0, gt=0, description="how often denied egress is counted and reported"
    )


class ContainerBackend(Backend):
    name = "container"
    preference = 20  # after fncall: a create that names no backend wants the cheapest
    capabilities = Capabilities(
        exec=True,
        files=True,
        stateful=True,
        snapshot=True,
        restore=True,
        fork=True,
        fs_diff=True,
        pause=True,
        isolation=[
            "pid",
            "mnt",
            "uts",
            "ipc",
            "net",
            "user",
            "overlay",
            "cgroups",
            "capabilities",
            "seccomp",
            "disk-quota",
        ],
        max_sandboxes=3200,
    )
    Config = ContainerConfig

    def __init__(self, config: ContainerConfig | None = None) -> None:
        super().__init__(config)
        self.capabilities = self.capabilities.model_copy(
            update={"max_sandboxes": self.config.max_sandboxes}
        )
        self.metas: dict[str, Meta] = {}
        self.lost: set[str] = set()  # sandboxes whose init ended by itself
        self._left: dict[str, list[Path]] = {}  # sandbox id -> exec groups left busy
        self._left_after: dict[str, int] = {}  # sandbox id -> how many its last sweep kept
        self._staged: dict[str, None] = {}  # digests mounted ahead of use, oldest first
        self._locks: dict[str, asyncio.Lock] = {}
        self._reads: dict[str, tuple[float, int]] = {}  # digest -> (measured at, bytes read)
        self._gc: asyncio.Task[None] | None = None
        self._watch_egress: asyncio.Task[None] | None = None
        self._watch_inodes: asyncio.Task[None] | None = None
        self._watch_swap: asyncio.Task[None] | None = None
        self._swap_check = asyncio.Event()  # a sandbox resumed or went: is swap still needed?
        self._closing = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if os.geteuid() != 0:
            return "needs root (namespaces, mounts, cgroups)"
        fs = Path("/proc/filesystems").read_text()
        for need in ("overlay", "erofs"):
            if need not in fs:
                return f"the kernel has no {need} filesystem"
        if not {*CONTROLLERS} <= v1_controllers().keys():
            return f"needs cgroup v1 {', '.join(CONTROLLERS)} hierarchies"
        if compiler() is None:
            return "needs a C compiler to build its helper (apt-get install gcc)"
        if "btrfs" not in fs:
            return "the kernel has no btrfs filesystem (sandboxes' disk quotas)"
        if shutil.which("mkfs.btrfs") is None:
            return "needs btrfs-progs for sandboxes' disk quotas (apt-get install btrfs-progs)"
        return None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, ctx: BackendContext) -> None:
        self.node = ctx.node
        self.state_dir = ctx.state_dir
        self._report_lost = ctx.lost
        self.store: LayerStore = open_store(
            self.config.storage, self.config.storage_config, state_dir=ctx.state_dir
        )
        _raise_open_files_limit()  # one pidfd per sandbox
        self.root = self.config.upper_root or ctx.state_dir / "sandboxes"
        size = int(self.config.upper_fs_gb * (1 << 30))
        self.fs = await asyncio.to_thread(
            UpperFs(
                self.root,
                ctx.state_dir / "sandboxes.btrfs",
                size,
                group_bytes=(self.config.tenant_disk_mb or 0) << 20 or None,
            ).open
        )
        os.chmod(self.root, 0o700)
        self.inode_limits = InodeLimits(self.fs)
        self.lanes = Lanes(self.config.lanes)
        self.file_slots = TenantSlots(
            self.config.file_ops, max(1, self.config.file_ops * 3 // 4), self.config.file_waiting
        )
        self.trash = Trash(self.root / ".trash", delete_tree(self.fs))
        self.helper = await asyncio.to_thread(
            Helper, ctx.state_dir / "bin", self.config.file_timeout_s
        )
        self.seccomp = write_profile(
            ctx.state_dir / "seccomp.bpf", ctx.hooks.guard_syscalls(self.name)
        )
        parents = {c: d for c, d in v1_controllers().items() if c in CONTROLLERS}
        own = hashlib.sha256(str(ctx.state_dir.resolve()).encode()).hexdigest()[:12]
        self.cgroups = Group.under(parents, f"dsec-container-{own}").create()
        self.memory_cap, pids_cap = host_reserve()  # all sandboxes together: the host keeps
        try:  # memory and process numbers of its own, whatever their limits add up to
            self.cgroups.set("memory", "memory.limit_in_bytes", self.memory_cap)
            self.cgroups.set("pids", "pids.max", pids_cap)
        except OSError as exc:
            log.warning("cannot cap what all sandboxes use together: %s", exc)
        self.uids = UidRanges()
        self.inits = Inits(self._init_ended)
        if why := favor_dynamic_changes():
            log.warning("starting a sandbox waits for an RCU grace period: %s", why)
        self.snapshots = Snapshots(
            self.store,
            self.config.snapshot_max_depth,
            self.config.snapshot_grace_s,
        )
        c = self.config
        try:
            self.egress = Egress(
                c.egress_subnet, c.egress_name, c.egress_allow, c.egress_deny, c.egress_max_flows
            )
        except ValueError as exc:
            raise errors.InvalidArgument(f"egress configuration: {exc}") from None
        self.hooks = ctx.hooks
        self._denied: dict[str, int] = {}
        accounted = (self.cgroups.dirs["memory"] / "memory.memsw.usage_in_bytes").exists()
        self._make_swap = self.config.pause_swap == "zram" and accounted
        if self.config.pause_swap == "zram" and not accounted:
            log.warning("the kernel does not account swap to memory cgroups (boot with "
                        "swapaccount=1): DSec makes no swap for paused sandboxes, whose memory "
                        "limits would not hold what they have there")  # fmt: skip
        self.swap = ZramSwap(
            self.config.zram_size_mb,
            hierarchy_root(self.cgroups.dirs["freezer"]),
            hierarchy_root(self.cgroups.dirs["memory"]),
        )
        held = await asyncio.to_thread(self.store.adopt, self.node)
        for sandbox_id, pidfd in await asyncio.to_thread(self._adopt, held):
            self.inits.watch(sandbox_id, pidfd)
        self._gc = asyncio.create_task(self._collect())
        self._watch_egress = asyncio.create_task(self._report_denied())
        self._watch_inodes = asyncio.create_task(self._hold_inodes())
        self._swap_check.set()  # a record left by an edge that died
        self._watch_swap = asyncio.create_task(self._drop_swap())

    async def close(self) -> None:
        """Sandboxes stay (a restarted edge adopts them); an empty cgroup parent, an unused
        egress bridge, the node's zram swap if nothing on the node is paused, and the
        sandboxes' filesystem, if nothing is left on it, go."""
        for task in (self._gc, self._watch_egress, self._watch_inodes):
            if task is not None:
                task.cancel()
        self.inits.close()
        await asyncio.to_thread(self.lanes.close)
        await asyncio.to_thread(self.trash.close)
        await asyncio.to_thread(self.egress.close)
        if self._watch_swap is not None:  # a last look, after the one under way
            self._closing = True
            self._swap_check.set()
            await self._watch_swap
        self.helper.close()
        for digest in self._staged:
            await asyncio.to_thread(self.store.release, digest, self._holder("prestaged"))
        self._staged.clear()
        if not self.metas:
            await asyncio.to_thread(self.cgroups.remove)
            await asyncio.to_thread(self.fs.close)

    def _adopt(self, held: dict[str, list[str]]) -> list[tuple[str, int]]:
        """After a restart: keep sandboxes whose init still runs (returns their pidfds);
        clean up the others, and what a create cut short left (a cgroup, holds on layers and
        snapshots, a uid range)."""
        kept: list[tuple[str, int]] = []
        for d in self.root.iterdir():
            if d.name.startswith(_PUBLISHING):  # a publish cut short
                remove_tree(d)
            if not _ID.match(d.name):
                continue
            sd = SandboxDir(self.root, d.name)
            try:
                meta = sd.read()
            except (OSError, ValueError):
                self._cleanup(sd, None, None)
                continue
            pidfd = Inits.open(meta.init_pid, meta.init_start) if meta.init_pid else None
            if pidfd is not None and meta.uid_base:
                self.metas[meta.id] = meta
                kept.append((meta.id, pidfd))
                self._watch_inodes_of(meta, known=False)
                if meta.address:
                    self.egress.adopt(meta.id, meta.address)
            else:
                why = "ran without a user namespace (an older DSec)" if pidfd else "lost its init"
                log.warning("sandbox %s %s while the edge was down; removing it", d.name, why)
                self._cleanup(sd, meta, pidfd)
        self.uids.adopt(self.root, {self.root / i: m.uid_base for i, m in self.metas.items()})
        for leftover in self.cgroups.dirs["memory"].iterdir():
            if leftover.is_dir() and leftover.name not in self.metas:
                Group.under(self.cgroups.dirs, leftover.name).remove(kill=True)
        for digest, holders in held.items():
            for holder in holders:
                if holder.split("/", 1)[-1] not in self.metas:
                    self.store.release(digest, holder)
        self.snapshots.drop_holders(
            self._snap_holder(""), keep={self._snap_holder(i) for i in self.metas}
        )
        return kept

    async def _collect(self) -> None:
        while True:
            await asyncio.sleep(self.config.gc_interval_s)
            try:
                removed = await asyncio.to_thread(self.snapshots.gc)
                if removed:
                    log.info("collected %d snapshot(s)", len(removed))
            except Exception:
                log.exception("snapshot collection failed")

    async def _report_denied(self) -> None:
        """Every ``egress_check_s``: what each egress sandbox tried and was refused since the
        last look (the host, other sandboxes, private ranges: a scan shows here) becomes a
        guard event ``egress_denied`` with the packets refused and the total so far."""
        while True:
            await asyncio.sleep(self.config.egress_check_s)
            if not self.egress.used:
                continue
            try:
                counts = await asyncio.to_thread(self.egress.denied)
            except errors.DsecError as exc:
                log.warning("cannot count denied egress: %s", exc)
                continue
            for sandbox_id, total in counts.items():
                new = total - self._denied.get(sandbox_id, 0)
                if new > 0:
                    await self.hooks.guard_event(
                        sandbox_id, "egress_denied", {"packets": new, "total": total}
                    )
            self._denied = counts

    async def _hold_inodes(self) -> None:
        """Every ``inode_check_s``: hold each sandbox to its inode limit (:mod:`.inodes`); a
        sandbox that reaches it becomes a guard event ``inodes_exceeded``."""
        while True:
            await asyncio.sleep(self.config.inode_check_s)
            try:
                changes = await asyncio.to_thread(self.inode_limits.check)
            except Exception:
                log.exception("holding sandboxes to their inode limits failed")
                continue
            for ch in changes:
                what = "full: its disk quota is closed" if ch.closed else "under again"
                log.info("sandbox %s holds %d inodes of %d: %s", ch.sandbox_id, ch.inodes,
                         ch.limit, what)  # fmt: skip
                if ch.closed:
                    await self.hooks.guard_event(
                        ch.sandbox_id, "inodes_exceeded", {"inodes": ch.inodes, "limit": ch.limit}
                    )

    def _watch_inodes_of(self, meta: Meta, known: bool) -> None:
        rw = SandboxDir(self.root, meta.id).rw
        limit = meta.inodes or self.config.inodes
        self.inode_limits.watch(meta.id, rw, limit, meta.disk_bytes, known)

    # -- sandboxes ---------------------------------------------------------------------------

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _meta(self, sandbox_id: str) -> Meta:
        """The sandbox's record; NotFound if unknown, SandboxLost if its init has ended."""
        meta = self.metas.get(sandbox_id)
        if meta is None:
            raise errors.NotFound(f"no container sandbox {sandbox_id} on this node")
        if sandbox_id in self.lost:
            raise errors.SandboxLost(
                f"sandbox {sandbox_id} is lost: its init ended; destroy it and create another"
            )
        return meta

    def _pidfd(self, sandbox_id: str) -> int:
        """A duplicate of the init's pidfd for one operation (the caller closes it): taken on
        the event loop, so a destroy meanwhile cannot hand its number to another process."""
        return os.dup(self.inits.pidfd(sandbox_id))

    def _init_ended(self, sandbox_id: str) -> None:
        """An init ended by itself (it cannot be killed from inside: the host did, or it
        crashed): the sandbox is lost at once, and the edge has it destroyed."""
        if sandbox_id not in self.metas or sandbox_id in self.lost:
            return
        log.warning("the init of sandbox %s ended; reporting it lost", sandbox_id)
        self.lost.add(sandbox_id)
        self._report_lost(sandbox_id, "its init process ended")

    def _holder(self, sandbox_id: str) -> str:
        """The sandbox as a holder of layers."""
        return f"{self.node}/{sandbox_id}"

    def _snap_holder(self, sandbox_id: str) -> str:
        """The sandbox as a holder of snapshots."""
        return f"sb.{self.node}.{sandbox_id}"

    def _group(self, sandbox_id: str) -> Group:
        return Group.under(self.cgroups.dirs, sandbox_id)

    def _procs(self, sandbox_id: str) -> list[Path]:
        return [d / "cgroup.procs" for d in self._group(sandbox_id).dirs.values()]

    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        if sandbox.id in self.metas or SandboxDir(self.root, sandbox.id).exists():
            raise errors.Conflict(f"sandbox {sandbox.id} already exists")
        self._check_limits(sandbox.spec.limits)
        async with self._lock(sandbox.id):
            try:
                meta, pidfd, refs = await asyncio.to_thread(self._create, sandbox)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise errors.CapacityExceeded(
                        "the node's disk for sandboxes is full; retry elsewhere"
                    ) from None
                log.exception("creating %s failed", sandbox.id)
                raise errors.Unavailable(
                    f"cannot create {sandbox.id}: {exc.strerror or exc}; retry"
                ) from None
            self.metas[sandbox.id] = meta
            self.inits.watch(sandbox.id, pidfd)
            self._watch_inodes_of(meta, known=True)
        return SandboxStatus(sandbox_id=sandbox.id, state="ready", layers=refs)

    def _layers_for(self, sandbox: EdgeSandbox) -> tuple[list[str], list[str], list[str]]:
        """(layer digests top first, snapshot chain newest first, the layers as
        SandboxStatus.layers names them) for a new sandbox."""
        spec = sandbox.spec
        if spec.snapshot:
            chain = self.snapshots.chain(spec.snapshot, sandbox.tenant)
            return chain[0].layers, [c.id for c in chain], []
        if spec.env is None:
            raise errors.InvalidArgument(
                "a container sandbox needs an env (base layer at least) or a snapshot to start "
                "from; `dsec layer ls` lists the layers"
            )
        layers = [
            self.store.resolve(ref.name, ref.version, ref.kind, tenant=sandbox.tenant)
            for ref in spec.env.refs()
        ]
        return [layer.digest for layer in layers], [], [x.listed for x in layers]

    def _create(self, sandbox: EdgeSandbox) -> tuple[Meta, int, list[str]]:
        spec = sandbox.spec
        sd = SandboxDir(self.root, sandbox.id)
        holder = self._holder(sandbox.id)
        mounted: list[str] = []
        meta = None
        try:
            layers, chain, refs = self._layers_for(sandbox)
            meta = Meta(
                id=sandbox.id, tenant=sandbox.tenant, created_at=sandbox.created_at,
                layers=layers, chain=chain, origin=chain, limits=spec.limits,
                network=spec.network, last_snapshot=chain[0] if chain else None,
                uid_base=self.uids.claim(sd.path),
                disk_bytes=(spec.limits.disk_mb or self.config.disk_mb) << 20,
                inodes=spec.limits.inodes or self.config.inodes,
            )  # fmt: skip
            if chain:
                self.snapshots.hold(chain[0], self._snap_holder(sandbox.id))
            lowers = self.snapshots.deltas(chain)
            for digest in layers:
                lowers.append(self.store.mount(digest, holder))
                mounted.append(digest)
            sd.create(self.fs, meta.disk_bytes, meta.tenant, len(lowers))
            self._limit(sandbox.id, spec.limits)
            if spec.network == "egress":
                meta.address = self.egress.create(sandbox.id, sd.path / "netns")
            pidfd = self._start_init(meta, sd, lowers)
            try:
                sd.write(meta)
            except BaseException:
                self._kill_init(sandbox.id, pidfd)
                raise
            return meta, pidfd, refs
        except BaseException:
            self._cleanup(sd, meta, None, chain=locals().get("chain", []), mounted=mounted)
            raise

    def _start_init(self, meta: Meta, sd: SandboxDir, lowers: list[Path]) -> int:
        """Start the sandbox's init on ``lowers`` and its upper; record it in ``meta``;
        returns its pidfd."""
        netns = sd.path / "netns" if meta.network == "egress" else None
        sd.mount_points(len(lowers))
        meta.init_pid, pidfd = self.helper.start_init(
            sd.path, lowers, meta.uid_base, self.config.hostname, self._procs(meta.id), netns
        )
        meta.init_start = process_start(meta.init_pid) or 0  # read while the pidfd holds it
        return pidfd

    def _check_limits(self, limits: Limits) -> None:
        """InvalidArgument for limits past what this node lets one sandbox have."""
        c = self.config
        maxima = (
            ("memory_mb", c.max_memory_mb or self.memory_cap >> 20, " MiB"),
            ("pids", c.max_pids, " processes"),
            ("disk_mb", c.max_disk_mb or self.fs.group_bytes >> 20, " MiB"),
            ("inodes", c.max_inodes, " inodes"),
        )
        for field, most, unit in maxima:
            asked = getattr(limits, field)
            if (asked or 0) > most:
                raise errors.InvalidArgument(
                    f"limits.{field} {asked} is over the {most}{unit} one container sandbox "
                    "may have on this node"
                )

    def _limit(self, sandbox_id: str, limits: Any) -> None:
        group = self._group(sandbox_id).create()
        c = self.config
        memory = (limits.memory_mb or c.memory_mb) << 20
        group.set("memory", "memory.limit_in_bytes", memory)
        memsw = group.dirs["memory"] / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # the limit holds for RAM and swap together: swap is for pausing
            memsw.write_text(str(memory))
        group.set("memory", "memory.swappiness", 0)  # and only a pause puts its memory there
        group.set("pids", "pids.max", limits.pids or c.pids)
        cpus = limits.cpus or c.cpus
        if cpus:
            group.set("cpu", "cpu.cfs_period_us", 100_000)
            group.set("cpu", "cpu.cfs_quota_us", int(cpus * 100_000))

    def _kill_init(self, sandbox_id: str, pidfd: int | None) -> None:
        """Kill the sandbox's init (so every process in it: they die with their PID
        namespace), wait until it has exited, close ``pidfd``. None: nothing to kill."""
        if pidfd is None:
            return
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            if is_frozen(group := self._group(sandbox_id)):  # frozen tasks die once thawed
                freeze(group, False)
            exited(pidfd, timeout=10)
        except ProcessLookupError:
            pass
        finally:
            os.close(pidfd)

    def _cleanup(
        self,
        sd: SandboxDir,
        meta: Meta | None,
        pidfd: int | None,
        chain: list[str] | None = None,
        mounted: list[str] | None = None,
    ) -> None:
        """Release everything a sandbox has (or a failed create took). Idempotent."""
        self._kill_init(sd.id, pidfd)
        self.inode_limits.forget(sd.id)
        holder = self._holder(sd.id)
        for digest in mounted if mounted is not None else (meta.layers if meta else []):
            self.store.release(digest, holder)
        held = set(chain or [])
        if meta is not None:
            held |= {*meta.chain, *meta.origin, *meta.held}
        self.snapshots.release(sorted(held), self._snap_holder(sd.id))
        if meta is not None and meta.network == "egress":
            self.egress.remove(sd.id, sd.path / "netns", meta.address)
        self._group(sd.id).remove(kill=True)  # an init whose record was never written, too
        if meta is not None and meta.uid_base:
            self.uids.release(meta.uid_base)
        sd.remove(self.trash)

    async def destroy(self, ref: SandboxRef) -> None:
        # its long work (a snapshot, an fs_diff) stops first: a snapshot holds the lock
        await self.lanes.cancel(ref.sandbox_id)
        async with self._lock(ref.sandbox_id):
            meta = self.metas.pop(ref.sandbox_id, None)
            pidfd = self.inits.take(ref.sandbox_id)
            self.lost.discard(ref.sandbox_id)
            self._left.pop(ref.sandbox_id, None)
            self._left_after.pop(ref.sandbox_id, None)
            sd = SandboxDir(self.root, ref.sandbox_id)
            if meta is None and not sd.path.exists():
                return
            if meta is None:
                try:
                    meta = sd.read()
                except (OSError, ValueError):
                    meta = None
            reads = {}
            if meta is not None and self.hooks.observes_layer_reads():
                reads = await asyncio.to_thread(self._layer_reads, meta.layers)
            await asyncio.to_thread(self._cleanup, sd, meta, pidfd)
        self._locks.pop(ref.sandbox_id, None)
        self._swap_check.set()
        for digest, bytes_read in reads.items():
            await self.hooks.layer_read(self.node, digest, ref.sandbox_id, bytes_read)

    def _layer_reads(self, digests: list[str]) -> dict[str, int]:
        """digest -> bytes of its image this node has read, measured while a sandbox still
        has it mounted (the store sees the mount's files only then). A measure walks the
        whole mounted image, whose files a tenant's published layer chooses: it is made at
        most once per layer every READS_FRESH_S, however many of its sandboxes go (a
        thousand destroys of one env had walked it a thousand times)."""
        reads = {}
        now = time.monotonic()
        for digest in dict.fromkeys(digests):
            at, seen = self._reads.get(digest, (-READS_FRESH_S, 0))
            if now - at < READS_FRESH_S:
                reads[digest] = seen
                continue
            try:
                reads[digest] = self.store.usage(digest).bytes_read
            except (errors.DsecError, OSError) as exc:  # its image gone from the store
                log.warning("cannot measure the reads of layer %s: %s", digest, exc)
                continue
            self._reads[digest] = (now, reads[digest])
        for digest in [d for d, (at, _) in list(self._reads.items()) if now - at >= READS_FRESH_S]:
            del self._reads[digest]  # (layers no longer used are forgotten)
        return reads

    async def status(self, ref: SandboxRef) -> SandboxStatus:
        if ref.sandbox_id not in self.metas:
            raise errors.NotFound(f"no container sandbox {ref.sandbox_id} on this node")
        alive = ref.sandbox_id not in self.lost and self.inits.alive(ref.sandbox_id)
        state = "lost" if not alive else "paused" if self._paused(ref.sandbox_id) else "ready"
        return SandboxStatus(sandbox_id=ref.sandbox_id, state=state)

    def _paused(self, sandbox_id: str) -> bool:
        return is_frozen(self._group(sandbox_id))

    async def pause(self, ref: SandboxRef) -> PauseReport:
        async with self._lock(ref.sandbox_id):
            meta = self._meta(ref.sandbox_id)
            return await self.lanes.run(meta.tenant, self._pause, meta.id, key=meta.id)

    async def prestage(self, layers: list[LayerRef], tenant: str | None = None) -> list[str]:
        """Mount each layer (held until the backend closes, or until :data:`PRESTAGED`
        newer ones are) and walk its tree, so its metadata is read from the store now rather
        than by the first sandbox."""
        return await self.lanes.run(tenant or "", self._prestage, layers, tenant)

    def _prestage(self, layers: list[LayerRef], tenant: str | None) -> list[str]:
        staged = []
        for ref in layers:
            layer = self.store.resolve(ref.name, ref.version, ref.kind, tenant=tenant)
            root = self.store.mount(layer.digest, self._holder("prestaged"))
            self._staged.pop(layer.digest, None)
            self._staged[layer.digest] = None
            while len(self._staged) > PRESTAGED:  # the oldest go (a tenant may ask for many)
                oldest = next(iter(self._staged))
                del self._staged[oldest]
                self.store.release(oldest, self._holder("prestaged"))
            for _ in os.walk(root):  # its metadata read ahead of the sandboxes that use it
                checkpoint()
            staged.append(layer.listed)
        return staged

    async def _drop_swap(self) -> None:
        """When a sandbox resumed or went (and every ``gc_interval_s``, for what that cannot
        see: another edge's, a freeze for a snapshot meanwhile), and a last time at close:
        remove the node's zram swap if nothing on the node is paused any more. In a thread:
        the swapoff moves what resumed sandboxes still have in swap back to RAM."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._swap_check.wait(), self.config.gc_interval_s)
            self._swap_check.clear()
            try:
                await asyncio.to_thread(self.swap.remove_if_unused)
            except Exception:
                log.exception("cannot remove the node's zram swap")
            if self._closing and not self._swap_check.is_set():
                return

    def _pause(self, sandbox_id: str) -> PauseReport:
        group = self._group(sandbox_id)
        with self.swap.pausing(make=self._make_swap) as why:
            if why:
                log.warning("%s", why)
            started = time.perf_counter()
            before, swapped_before = memory_charge(group)
            group.set("memory", "memory.swappiness", 100)  # a running sandbox's is 0
            freeze(group, True)
            reclaim(group)
        after, swapped = memory_charge(group)
        return PauseReport(
            sandbox_id=sandbox_id, state="paused", seconds=time.perf_counter() - started,
            memory_before_bytes=before + swapped_before, memory_after_bytes=after,
            swapped_bytes=swapped,
        )  # fmt: skip

    async def resume(self, ref: SandboxRef) -> PauseReport:
        async with self._lock(ref.sandbox_id):
            meta = self._meta(ref.sandbox_id)
            group = self._group(meta.id)
            started = time.perf_counter()
            group.set("memory", "memory.swappiness", 0)
            await asyncio.to_thread(freeze, group, False)
            self._swap_check.set()
            ram, swapped = memory_charge(group)
            return PauseReport(
                sandbox_id=meta.id, state="ready", seconds=time.perf_counter() - started,
                memory_before_bytes=ram + swapped, memory_after_bytes=ram, swapped_bytes=swapped,
            )  # fmt: skip

    async def list_sandboxes(self) -> list[str]:
        """Sandboxes whose init runs: one whose init died is left out, so the edge's
        reconciliation reports it lost (and then has it destroyed)."""
        return sorted(i for i in self.metas if i not in self.lost and self.inits.alive(i))

    # -- work inside -------------------------------------------------------------------------

    async def exec(self, call: ExecCall) -> ExecResult:
        meta = self._meta(call.sandbox_id)
        limits = meta.limits.model_copy(update=call.limits.model_dump(exclude_none=True))
        # the command and all it starts go into a freezer group of their own, so a timeout
        # kills every one of them (setsid or not) and nothing else in the sandbox
        sandbox = self._group(call.sandbox_id)
        own = Group({"freezer": sandbox.dirs["freezer"] / f"exec-{secrets.token_hex(6)}"})
        await asyncio.to_thread(own.create)
        cgroups = [d / "cgroup.procs" for c, d in sandbox.dirs.items() if c != "freezer"]
        pidfd = self._pidfd(call.sandbox_id)
        try:
            result = await self.helper.exec(
                pidfd,
                call.argv,
                cgroups=[*cgroups, own.dirs["freezer"] / "cgroup.procs"],
                kill_all=own.kill,  # frozen meanwhile: none can fork
                env={**DEFAULT_ENV, **call.env},
                cwd=call.cwd or "/",
                stdin=call.stdin,
                timeout=call.timeout_s,
                max_output=call.max_output_bytes,
                seccomp=self.seccomp,
                user=call.user,
                file_size=(limits.file_size_mb << 20) if limits.file_size_mb else None,
            )
        finally:
            os.close(pidfd)
            if _busy_group(own.dirs["freezer"]):  # it left processes running
                self._leave(call.sandbox_id, own.dirs["freezer"])
        return result.model_copy(update={"sandbox_id": call.sandbox_id})

    def _leave(self, sandbox_id: str, group: Path) -> None:
        """Keep an exec group that its command left busy; remove those emptied since once
        their count has doubled (each exec pays a constant share of that), so a stream of
        ``cmd &`` leaves no more groups behind than about twice its processes still running."""
        left = self._left.setdefault(sandbox_id, [])
        left.append(group)
        if len(left) >= 2 * self._left_after.get(sandbox_id, 16):
            left[:] = [g for g in left if _busy_group(g)]
            self._left_after[sandbox_id] = max(16, len(left))

    def _charged(self, sandbox_id: str) -> list[Path]:
        """What a helper acting on the sandbox joins: its cpu, memory and pids groups (not
        its freezer: a paused sandbox's files can still be read)."""
        group = self._group(sandbox_id)
        return [group.dirs[c] / "cgroup.procs" for c in ("cpu", "memory", "pids")]

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        meta = self._meta(request.sandbox_id)
        async with self.file_slots.hold(meta.tenant, deadline.inner(None)):
            pidfd = self._pidfd(request.sandbox_id)
            try:
                data = await self.helper.read_file(
                    pidfd, request.path, MAX_FILE_BYTES, self._charged(meta.id)
                )
            finally:
                os.close(pidfd)
        return ReadFileResponse(data=data)

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        meta = self._meta(request.sandbox_id)
        name = request.path.rstrip("/").rpartition("/")[2]
        if not name or name in (".", "..") or "\0" in request.path:
            raise errors.InvalidArgument(f"{request.path!r}: not a file path")
        async with self.file_slots.hold(meta.tenant, deadline.inner(None)):
            pidfd = self._pidfd(request.sandbox_id)
            try:
                await self.helper.write_file(
                    pidfd, request.path, request.data, request.mode, self._charged(meta.id)
                )
            finally:
                os.close(pidfd)
        return WriteFileResponse(size=len(request.data))

    # -- state -------------------------------------------------------------------------------

    async def snapshot(self, request: SnapshotRequest) -> SnapshotInfo:
        async with self._lock(request.sandbox_id):
            meta = self._meta(request.sandbox_id)
            snap = await self.lanes.run(
                meta.tenant, self._snapshot, meta, request.keep, key=meta.id
            )
        return SnapshotInfo(
            id=snap.id, sandbox_id=snap.sandbox_id, tenant=snap.tenant, backend=self.name,
            parent=snap.parent, depth=snap.depth, created_at=snap.created_at, bytes=snap.bytes,
        )  # fmt: skip

    def _snapshot(self, meta: Meta, keep: bool):
        sd = SandboxDir(self.root, meta.id)
        group = self._group(meta.id)
        busy = len((group.dirs["pids"] / "cgroup.procs").read_text().split()) > 1
        busy = busy and not is_frozen(group)  # a paused sandbox stays paused
        if busy:  # processes besides init: hold them still while the upper is read
            freeze(group, True)
        try:
            snap = self.snapshots.take(
                sd.upper, tenant=meta.tenant, sandbox_id=meta.id, backend=self.name,
                layers=meta.layers, parent=meta.last_snapshot, baseline=meta.upper_since,
                keep=keep,
            )  # fmt: skip
        finally:
            if busy:
                freeze(group, False)
        self.snapshots.hold(snap.id, self._snap_holder(meta.id))
        meta.held.append(snap.id)
        meta.last_snapshot = snap.id
        meta.upper_since = snap.id
        sd.write(meta)
        return snap

    async def restore(self, request: RestoreRequest) -> None:
        await self.lanes.cancel(request.sandbox_id, "the sandbox was restored while this ran")
        async with self._lock(request.sandbox_id):
            meta = self._meta(request.sandbox_id)
            chain = await asyncio.to_thread(self._restore_chain, meta, request.snapshot_id)
            old = self.inits.take(meta.id)  # killed on purpose: not "lost"
            try:
                pidfd = await asyncio.to_thread(self._restore, meta, old, chain)
            except BaseException:
                self._init_ended(meta.id)  # its init is gone: the sandbox with it
                raise
            self.inits.watch(meta.id, pidfd)

    def _restore_chain(self, meta: Meta, snapshot_id: str | None) -> list[str]:
        """The chain a restore to ``snapshot_id`` starts from, held (collection cannot take
        it meanwhile); errors before anything changed."""
        if snapshot_id is None:
            chain = meta.origin
        else:
            snaps = self.snapshots.chain(snapshot_id, meta.tenant)
            if snaps[0].layers != meta.layers:
                raise errors.InvalidArgument(
                    f"snapshot {snapshot_id} is of another environment; fork it instead "
                    "(create with from_snapshot)"
                )
            chain = [s.id for s in snaps]
        if chain:
            self.snapshots.hold(chain[0], self._snap_holder(meta.id))
        return chain

    def _restore(self, meta: Meta, old: int | None, chain: list[str]) -> int:
        """Kill the init (``old``), start a new one on an empty upper over ``chain``;
        returns its pidfd."""
        sd = SandboxDir(self.root, meta.id)
        self._kill_init(meta.id, old)
        sd.fresh_upper(self.trash, self.fs, meta.disk_bytes, meta.tenant)
        self._watch_inodes_of(meta, known=True)
        mounts = self.store.mounted()  # its layers are; mount again what went behind its back
        layers = [mounts.get(d) or self.store.mount(d, self._holder(meta.id)) for d in meta.layers]
        pidfd = self._start_init(meta, sd, self.snapshots.deltas(chain) + layers)
        old_chain = set(meta.chain) - set(chain)
        meta.chain = chain
        meta.last_snapshot = chain[0] if chain else None
        meta.upper_since = None
        sd.write(meta)
        self.snapshots.release(
            sorted(old_chain - set(meta.held) - set(meta.origin[:1])), self._snap_holder(meta.id)
        )
        return pidfd

    async def fs_diff(self, request: FsDiffRequest) -> FsDiff:
        meta = self._meta(request.sandbox_id)
        return await self.lanes.run(meta.tenant, self._fs_diff, meta, request.since, key=meta.id)

    def _fs_diff(self, meta: Meta, since: str | None) -> FsDiff:
        sd = SandboxDir(self.root, meta.id)
        env = [self.store.mounted()[d] for d in meta.layers]
        now = [sd.upper, *self.snapshots.deltas(meta.chain)]
        if since is None:
            then = self.snapshots.deltas(meta.origin)
        else:
            snaps = self.snapshots.chain(since, meta.tenant)
            if snaps[0].layers != meta.layers:
                raise errors.InvalidArgument(f"snapshot {since} is of another environment")
            then = self.snapshots.deltas([s.id for s in snaps])
        return diff(now, then, env)

    async def publish(self, request: PublishRequest) -> LayerInfo:
        return await self.lanes.run(request.tenant, self._publish, request)

    def _publish(self, request: PublishRequest) -> LayerInfo:
        snaps = self.snapshots.chain(request.snapshot_id, request.tenant)
        layers = snaps[0].layers  # top first; the base last
        holder = f"{self.node}/publish-{secrets.token_hex(6)}"
        # built where only root goes (the sandboxes' 0700 directory): it holds the tenant's
        # files as they are, set-id bits and all
        tree = Path(tempfile.mkdtemp(prefix=_PUBLISHING, dir=self.root))
        try:
            use = layers if request.kind == "base" else layers[:-1]
            for digest in reversed(use):  # bottom up: overlay order
                apply(self.store.mount(digest, holder), tree, keep_whiteouts=request.kind != "base")
            for delta in reversed(self.snapshots.deltas([s.id for s in snaps])):
                apply(delta, tree, keep_whiteouts=request.kind != "base")
            layer = self.store.import_layer(
                str(tree), request.kind, request.name, request.version, tenant=request.tenant
            )
        except errors.Internal as exc:  # (its message names this node's paths)
            log.warning("publishing %s failed: %s", request.snapshot_id, exc.message)
            raise errors.Internal(
                f"publishing snapshot {request.snapshot_id} failed; the edge's log says why"
            ) from None
        finally:
            for digest in layers:
                self.store.release(digest, holder)
            remove_tree(tree)
        return LayerInfo(digest=layer.digest, kind=layer.kind, name=layer.name,
                         version=layer.version, size=layer.size)  # fmt: skip


def _raise_open_files_limit() -> None:
    """Let this process hold a descriptor per sandbox (its init's pidfd)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _busy_group(group: Path) -> bool:
    """Remove cgroup ``group`` if it is empty; whether it is still there (busy, or not
    removable now: it goes with its sandbox)."""
    try:
        os.rmdir(group)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return False
