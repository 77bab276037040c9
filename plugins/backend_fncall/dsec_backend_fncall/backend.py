"""The fncall backend (edge side): starts the supervisor and speaks the agent protocol to it.

A fncall *sandbox* is a directory of files (its ``/tmp``) and its limits; it holds no process
between calls. Every command runs in a fresh worker that sees those files copy-on-write, so
what one call writes or starts is gone before the next (``stateful: false``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

import dsec_backend_fncall
import dsec_kernel
from dsec_backend_fncall.seccomp import compile_profile
from dsec_backend_fncall.supervisor import DEFAULT_ENV, SupervisorConfig
from dsec_kernel.agent import AgentClient
from dsec_kernel.contract import errors
from dsec_kernel.contract.agent import agent_pb2 as pb
from dsec_kernel.contract.backend import (
    Backend,
    BackendContext,
    Capabilities,
    ExecCall,
    SandboxRef,
    SandboxStatus,
)
from dsec_kernel.contract.wire import (
    MAX_FILE_BYTES,
    SANDBOX_ID_PATTERN,
    EdgeSandbox,
    ExecResult,
    FncallRequest,
    Limits,
    ReadFileRequest,
    ReadFileResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from dsec_kernel.linuxhost.cgroups import favor_dynamic_changes, v1_controllers
from dsec_kernel.linuxhost.fileio import remove_tree
from dsec_kernel.linuxhost.procs import die_with_parent

__all__ = ["FncallBackend", "FncallConfig"]

log = logging.getLogger(__name__)
_ID = re.compile(SANDBOX_ID_PATTERN)
#: what of the host calls see by default: its programs and libraries
VIEW_PATHS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr")
#: and of its /etc: what programs need to run, nothing a host's operator configures
VIEW_ETC = (
    "passwd", "group", "hosts", "host.conf", "nsswitch.conf", "resolv.conf", "ld.so.cache",
    "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
    "ca-certificates.conf", "localtime", "timezone", "mime.types", "protocols", "services",
    "os-release", "debian_version", "shells", "bash.bashrc", "profile", "profile.d",
    "environment", "login.defs", "terminfo", "magic", "magic.mime", "inputrc",
    "locale.alias", "mtab", "python3", "perl",
)  # fmt: skip


class FncallConfig(BaseModel):
    """``DSEC_BACKEND_CONFIG__FNCALL__<FIELD>``; see the plugin's README."""

    model_config = ConfigDict(extra="forbid")

    pool_size: int = Field(8, ge=1, le=1024, description="workers kept ready")
    max_running: int = Field(64, ge=1, le=4096, description="calls running at once")
    tenant_max_running: int | None = Field(
        None, ge=1, description="calls one tenant runs at once (default: 3/4 of max_running)"
    )
    tenant_max_waiting: int = Field(
        4096, ge=0, description="calls of one tenant waiting for a turn (more: QueueFull)"
    )
    max_sandboxes: int = Field(100_000, ge=1, description="sandboxes one node holds")
    tmp_size_mb: int = Field(64, ge=1, description="each call's /tmp")
    memory_mb: int = Field(512, ge=32, description="default address-space limit per call")
    processes: int = Field(64, ge=1, description="default process limit per call")
    file_size_mb: int = Field(64, ge=1, description="default largest file a call writes")
    files_mb: int = Field(64, ge=1, description="default Limits.disk_mb of a sandbox's files")
    files_inodes: int = Field(4096, ge=16, description="default Limits.inodes of its files")
    files_total_mb: int = Field(
        4096, ge=1, description="what every sandbox's files may take together on the node"
    )
    files_total_inodes: int = Field(
        262_144, ge=16, description="files and directories of every sandbox together"
    )
    max_files_mb: int = Field(1024, ge=1, description="largest Limits.disk_mb a sandbox may ask")
    max_files_inodes: int = Field(65_536, ge=16, description="largest Limits.inodes likewise")
    max_memory_mb: int = Field(4096, ge=32, description="largest memory limit a call may ask for")
    max_processes: int = Field(1024, ge=1, description="largest process limit a call may ask for")
    max_file_size_mb: int = Field(
        1024, ge=1, description="largest file size limit a call may ask for"
    )
    uid_base: int = Field(
        200_000, ge=1000, description="first uid calls run as; uid_base - 1 is their group"
    )
    uid_count: int = Field(4096, ge=16, description="uids reserved for calls")
    view_paths: list[str] = Field(
        default_factory=lambda: list(VIEW_PATHS),
        description="host paths calls see, read-only (with the interpreter's tree); nothing "
        "else of the host is in their view",
    )
    loopback: bool = Field(False, description="bring lo up in each call's network namespace")
    cgroups: bool = Field(True, description="limit each call's memory and processes by cgroup")
    startup_timeout_s: float = Field(30.0, gt=0)

    view_etc: list[str] = Field(
        default_factory=lambda: list(VIEW_ETC),
        description="entries of the host's /etc calls see (names, no /)",
    )

    @field_validator("view_etc")
    @classmethod
    def _plain_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"{name!r}: /etc entries are plain names")
        return names

    @field_validator("view_paths")
    @classmethod
    def _absolute_below_root(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or os.path.normpath(path) != path or path == "/":
                raise ValueError(f"{path!r}: view paths are absolute, normal and not /")
        return paths


def _kernel_at_least(major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return bool(m) and (int(m[1]), int(m[2])) >= (major, minor)


class FncallBackend(Backend):
    name = "fncall"
    preference = 10  # the cheapest sandbox: what a create that names no backend gets
    capabilities = Capabilities(
        exec=True,
        files=True,
        stateful=False,
        fncall_languages=["python", "bash"],
        isolation=["pid", "mnt", "net", "ipc", "uts", "uid", "rlimits", "seccomp"],
        max_sandboxes=100_000,
    )
    Config = FncallConfig

    def __init__(self, config: FncallConfig | None = None) -> None:
        super().__init__(config)
        self.capabilities = self.capabilities.model_copy(
            update={"max_sandboxes": self.config.max_sandboxes}
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.agent: AgentClient | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._limits: dict[str, Limits] = {}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if os.geteuid() != 0:
            return "needs root (it creates namespaces and mounts); run the edge as root"
        if not _kernel_at_least(5, 12):
            return f"needs Linux 5.12+ (mount_setattr); this is {os.uname().release}"
        try:
            import pyseccomp  # noqa: F401
        except (ImportError, OSError) as exc:
            return f"libseccomp is not usable: {exc}"
        return None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, ctx: BackendContext) -> None:
        self.state_dir = ctx.state_dir
        if self.config.cgroups and {"memory", "pids"} <= v1_controllers().keys():
            self.capabilities = self.capabilities.model_copy(
                update={"isolation": [*self.capabilities.isolation, "cgroups"]}
            )
            if why := favor_dynamic_changes():
                log.warning("each call's cgroup move waits for an RCU grace period: %s", why)
        self.root = ctx.state_dir / "sandboxes"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.socket = ctx.state_dir / "agent.sock"
        code_dirs = sorted(  # (the zygote imports all it runs before it enters the view)
            {
                str(Path(m.__file__).resolve().parent.parent)
                for m in (dsec_kernel, dsec_backend_fncall)
            }
        )
        prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
        shared = ("pool_size", "max_running", "tenant_max_running", "tenant_max_waiting",
                  "tmp_size_mb", "memory_mb",
                  "processes", "file_size_mb", "uid_base", "uid_count", "loopback",
                  "cgroups", "files_mb", "files_inodes", "files_total_mb",
                  "files_total_inodes")  # fmt: skip
        self.supervisor_config = SupervisorConfig(
            socket=str(self.socket),
            files_root=str(self.root),
            view_paths=self.config.view_paths,
            view_etc=self.config.view_etc,
            keep=sorted(prefixes),
            hide=[str(ctx.state_dir.resolve())],
            bpf_hex=compile_profile(ctx.hooks.guard_syscalls(self.name)).hex(),
            sys_path=code_dirs,
            **self.config.model_dump(include=set(shared)),
        )
        for meta in self.root.glob("*/limits.json"):
            self._limits[meta.parent.name] = Limits.model_validate_json(meta.read_text())
        await self._start_supervisor()
        self._watchdog = asyncio.create_task(self._watch())

    async def _start_supervisor(self) -> None:
        """Start the supervisor with a clean environment: the edge's (which holds the NATS
        service credential) never reaches it, its zygote or any call."""
        log_path = self.state_dir / "supervisor.log"
        env = {
            "PATH": DEFAULT_ENV["PATH"],
            "LANG": "C.UTF-8",
            "PYTHONPATH": os.pathsep.join(self.supervisor_config.sys_path),
        }
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dsec_backend_fncall.supervisor",
                    self.supervisor_config.model_dump_json(),
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd="/",  # never the edge's working directory, nor its terminal
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),
            )
        if self.agent is None:
            self.agent = AgentClient(f"unix://{self.socket}")
        try:
            await self.agent.wait_ready(self.config.startup_timeout_s)
        except errors.Unavailable:
            tail = log_path.read_text(errors="replace").splitlines()[-10:]
            raise errors.Unavailable(
                "the fncall supervisor did not start:\n  " + "\n  ".join(tail)
            ) from None

    async def _watch(self) -> None:
        """Restart the supervisor if it dies (calls in flight fail; sandboxes' files stay)."""
        while True:
            await asyncio.sleep(1.0)
            if self.proc is not None and self.proc.poll() is not None:
                log.error("fncall supervisor exited with %s; restarting", self.proc.returncode)
                try:
                    await self._start_supervisor()
                except errors.Unavailable:
                    log.exception("restarting the fncall supervisor failed")

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self.agent is not None:
            await self.agent.close()
            self.agent = None

    # -- sandboxes ---------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        d = self.root / sandbox_id
        if not d.is_dir():
            raise errors.NotFound(f"no fncall sandbox {sandbox_id} on this node")
        return d

    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        self._checked(sandbox.spec.limits)
        d = self.root / sandbox.id
        try:
            (d / "files").mkdir(parents=True)
            os.chown(d / "files", 0, self.config.uid_base - 1)
            os.chmod(d / "files", 0o777)
            (d / "limits.json").write_text(sandbox.spec.limits.model_dump_json())
        except FileExistsError:
            raise errors.Conflict(f"sandbox {sandbox.id} already exists") from None
        except OSError as exc:  # (strerror: the message names no host path)
            shutil.rmtree(d, ignore_errors=True)
            raise errors.Unavailable(
                f"cannot create sandbox {sandbox.id}: {exc.strerror}"
            ) from None
        self._limits[sandbox.id] = sandbox.spec.limits
        return SandboxStatus(sandbox_id=sandbox.id, state="ready")

    async def destroy(self, ref: SandboxRef) -> None:
        """Remove the files, then kill the calls: a call still waiting for a slot finds no
        sandbox when its turn comes (``NotFound``), one that has its slot is killed."""
        d = self.root / ref.sandbox_id
        self._limits.pop(ref.sandbox_id, None)
        if d.exists():
            await asyncio.to_thread(remove_tree, d)
        if self.agent is not None:
            try:
                await self.agent.signal(ref.sandbox_id, signal.SIGKILL)
            except errors.DsecError as exc:
                log.warning("could not stop %s's calls: %s", ref.sandbox_id, exc)

    async def status(self, ref: SandboxRef) -> SandboxStatus:
        self._dir(ref.sandbox_id)
        return SandboxStatus(sandbox_id=ref.sandbox_id, state="ready")

    async def list_sandboxes(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if _ID.match(p.name))

    # -- calls -------------------------------------------------------------------------------

    def _limits_for(self, sandbox_id: str, given: Limits) -> Limits:
        """The sandbox's limits, overridden by those a call gives."""
        own = self._limits.get(sandbox_id, Limits())
        return self._checked(own.model_copy(update=given.model_dump(exclude_none=True)))

    def _checked(self, limits: Limits) -> Limits:
        """``limits``; InvalidArgument if one is past what this node lets a call have."""
        c = self.config
        for name, asked, most, unit in (
            ("memory_mb", limits.memory_mb, c.max_memory_mb, "MiB"),
            ("pids", limits.pids, c.max_processes, "processes"),
            ("file_size_mb", limits.file_size_mb, c.max_file_size_mb, "MiB"),
            ("disk_mb", limits.disk_mb, c.max_files_mb, "MiB"),
            ("inodes", limits.inodes, c.max_files_inodes, "files"),
        ):
            if (asked or 0) > most:
                raise errors.InvalidArgument(
                    f"limits.{name} {asked} is over the {most} {unit} a fncall may have here"
                )
        return limits

    def _pb_limits(self, limits: Limits) -> pb.Limits:
        return pb.Limits(
            memory_bytes=(limits.memory_mb or 0) << 20,
            processes=limits.pids or 0,
            file_size_bytes=(limits.file_size_mb or 0) << 20,
        )

    async def exec(self, call: ExecCall) -> ExecResult:
        self._dir(call.sandbox_id)
        assert self.agent is not None
        limits = self._limits_for(call.sandbox_id, call.limits)
        return await self.agent.exec(
            pb.ExecRequest(
                sandbox=call.sandbox_id,
                argv=call.argv,
                env=call.env,
                cwd=call.cwd or "",
                stdin=call.stdin,
                timeout_s=call.timeout_s,
                max_output_bytes=call.max_output_bytes,
                limits=self._pb_limits(limits),
                user=call.user or "",
                tenant=call.tenant,
            )
        )

    async def fncall(self, request: FncallRequest) -> ExecResult:
        assert self.agent is not None
        limits = self._checked(request.limits)
        if request.sandbox_id:
            self._dir(request.sandbox_id)
            limits = self._limits_for(request.sandbox_id, limits)
        return await self.agent.exec(
            pb.ExecRequest(
                sandbox=request.sandbox_id or "",
                language=request.language,
                code=request.code,
                env=request.env,
                stdin=request.stdin,
                timeout_s=request.timeout_s,
                max_output_bytes=request.max_output_bytes,
                limits=self._pb_limits(limits),
                tenant=request.tenant or "",
            )
        )

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        assert self.agent is not None
        data = await self.agent.read_file(request.sandbox_id, request.path, MAX_FILE_BYTES)
        return ReadFileResponse(data=data)

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        assert self.agent is not None
        size = await self.agent.write_file(
            request.sandbox_id, request.path, request.data, request.mode
        )
        return WriteFileResponse(size=size)
