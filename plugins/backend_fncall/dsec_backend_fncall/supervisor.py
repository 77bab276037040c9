"""The fncall supervisor: serves the kernel's agent protocol for the warm pool.

``python -m dsec_backend_fncall.supervisor CONFIG_JSON`` (started by the edge's fncall backend,
with a clean environment). It starts the zygote (:mod:`dsec_backend_fncall.zygote`), keeps
``pool_size`` workers ready (:mod:`dsec_backend_fncall.pool`), and serves ``Agent`` on a unix
socket: each Exec waits for a slot (shared fairly between tenants:
:mod:`dsec_kernel.fairshare`), takes one fresh worker, streams its output and reports
its exit; the worker is never reused. At the timeout the call is killed unless its worker has
really exited: the supervisor trusts the kernel (pidfd, cgroup), never what a call says.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field

from dsec_backend_fncall.filespace import BLOCK, MAX_DEPTH, FileSpace, cost
from dsec_backend_fncall.pool import Pool, Worker
from dsec_kernel.agent.client import ERROR_CODE_KEY, unix_target
from dsec_kernel.contract import errors
from dsec_kernel.contract.agent import agent_pb2 as pb
from dsec_kernel.contract.agent.agent_pb2_grpc import AgentServicer, add_AgentServicer_to_server
from dsec_kernel.contract.wire import SANDBOX_ID_PATTERN
from dsec_kernel.fairshare import TenantSlots
from dsec_kernel.linuxhost.fileio import read_whole

__all__ = ["SupervisorConfig", "main"]

log = logging.getLogger("dsec.fncall.supervisor")

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
}
LANGUAGES = {"python": None, "bash": ["/bin/bash", "-c"]}
_MAX_PENDING = 1 << 20
_SANDBOX = re.compile(SANDBOX_ID_PATTERN)


class SupervisorConfig(BaseModel):
    """Everything the supervisor and its zygote need (the backend fills it in)."""

    model_config = ConfigDict(extra="forbid")

    socket: str
    files_root: str
    pool_size: int = Field(8, ge=1)
    max_running: int = Field(64, ge=1)
    tenant_max_running: int | None = Field(None, ge=1)
    tenant_max_waiting: int = Field(4096, ge=0)
    tmp_size_mb: int = Field(64, ge=1)
    memory_mb: int = Field(512, ge=32)
    processes: int = Field(64, ge=1)
    file_size_mb: int = Field(64, ge=1)
    open_files: int = Field(1024, ge=16)
    files_mb: int = Field(64, ge=1)
    files_inodes: int = Field(4096, ge=16)
    files_total_mb: int = Field(4096, ge=1)
    files_total_inodes: int = Field(262_144, ge=16)
    uid_base: int = Field(200_000, ge=1000)
    uid_count: int = Field(4096, ge=16)
    view_paths: list[str]
    view_etc: list[str]
    keep: list[str]
    hide: list[str]
    bpf_hex: str
    sys_path: list[str]
    hostname: str = "sandbox"
    loopback: bool = False
    cgroups: bool = True


def tenant_share(cfg: SupervisorConfig) -> int:
    """Calls one tenant may run at once: ``tenant_max_running``, by default three quarters
    of ``max_running`` (at least 1), so that other tenants always find slots free."""
    if cfg.tenant_max_running is not None:
        return min(cfg.tenant_max_running, cfg.max_running)
    return max(1, cfg.max_running - cfg.max_running // 4)


@dataclass(eq=False)
class _Call:
    """A call holding a slot; ``worker`` once one has accepted it. A SIGKILL that comes
    before then marks it ``doomed``: its worker is killed as soon as it has one."""

    sandbox: str
    worker: Worker | None = None
    doomed: bool = False

    def signal(self, sig: int) -> bool:
        if self.worker is None:
            self.doomed = self.doomed or sig == signal.SIGKILL
            return self.doomed
        return self.worker.kill() if sig == signal.SIGKILL else self.worker.signal(sig)


class Agent(AgentServicer):
    """The agent protocol over the pool. A sandbox's files live in ``files_root/<id>/files/``,
    which calls see as their /tmp. Files belong to root and the sandbox group (every call's
    group), which gets the owner's permission bits."""

    def __init__(self, cfg: SupervisorConfig, pool: Pool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.slots = TenantSlots(cfg.max_running, tenant_share(cfg), cfg.tenant_max_waiting)
        self.running: set[_Call] = set()
        self.files_root = Path(cfg.files_root)
        self.gid = cfg.uid_base - 1
        self.space = FileSpace(
            self.files_root, cfg.files_mb, cfg.files_inodes, cfg.files_total_mb,
            cfg.files_total_inodes,
        )  # fmt: skip

    # -- exec --------------------------------------------------------------------------------

    def _spec(self, req: pb.ExecRequest) -> dict:
        if req.language:
            if req.language not in LANGUAGES:
                raise ValueError(
                    f"language {req.language!r} is not served; use one of {sorted(LANGUAGES)}"
                )
            if not req.code:
                raise ValueError("no code to run")
            prefix = LANGUAGES[req.language]
            mode, argv = ("python", []) if prefix is None else ("argv", [*prefix, req.code])
        else:
            if not req.argv or not req.argv[0]:
                raise ValueError("empty command")
            mode, argv = "argv", list(req.argv)
        if not req.timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        if req.cwd and not req.cwd.startswith("/"):
            raise ValueError("cwd must be an absolute path")
        if req.user:
            raise ValueError(
                "fncall runs every call as its own unprivileged user; `user` is not supported"
            )
        if req.sandbox and not _SANDBOX.match(req.sandbox):
            raise ValueError(f"bad sandbox id {req.sandbox!r}")
        if any("\0" in a for a in (*argv, req.cwd, *req.env, *req.env.values())):
            raise ValueError("argv, cwd and env cannot hold NUL characters")
        if any(not k or "=" in k for k in req.env):
            raise ValueError("environment names must be non-empty and hold no '='")
        lim = req.limits
        return {
            "mode": mode,
            "code": req.code if mode == "python" else "",
            "argv": argv,
            "env": {**DEFAULT_ENV, **dict(req.env)},
            "cwd": req.cwd or "/tmp",
            "sandbox": req.sandbox,
            "tenant_group": "t-" + hashlib.sha256(req.tenant.encode()).hexdigest()[:16],
            "limits": {
                "memory_bytes": lim.memory_bytes or self.cfg.memory_mb << 20,
                "processes": lim.processes or self.cfg.processes,
                "file_size_bytes": lim.file_size_bytes or self.cfg.file_size_mb << 20,
                "open_files": lim.open_files or self.cfg.open_files,
                "cpu_seconds": math.ceil(req.timeout_s) + 1,
            },
        }

    @asynccontextmanager
    async def _turn(
        self, request: pb.ExecRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        """A slot for the call, waited for only while it could still end before its caller's
        deadline; a tenant's queue past ``tenant_max_waiting`` is refused at once."""
        left = context.time_remaining()
        wait = None if left is None else max(0.0, left - request.timeout_s - 1)
        try:
            await self.slots.acquire(request.tenant, wait)
        except (errors.QueueFull, errors.DeadlineExceeded) as exc:
            status = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(exc, errors.QueueFull)
                else grpc.StatusCode.DEADLINE_EXCEEDED
            )
            await context.abort(
                status, exc.message, trailing_metadata=((ERROR_CODE_KEY, exc.code),)
            )
        try:
            yield
        finally:
            self.slots.release(request.tenant)

    async def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext):
        try:
            spec = self._spec(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not self._exists(request.sandbox):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.sandbox}")
        async with self._turn(request, context):
            if not self._exists(request.sandbox):  # destroyed while the call waited
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.sandbox}")
            call = _Call(request.sandbox)
            self.running.add(call)
            try:
                call.worker = worker = await self._hand_over(spec, context)
            except BaseException:
                self.running.discard(call)
                raise
            if call.doomed:
                worker.kill()
            try:
                async for event in _run(
                    worker, request.stdin, request.timeout_s, request.max_output_bytes
                ):
                    yield event
            finally:
                self.running.discard(call)
                self.pool.release()

    def _exists(self, sandbox: str) -> bool:
        return not sandbox or (self.files_root / sandbox / "files").is_dir()

    async def _hand_over(self, spec: dict, context: grpc.aio.ServicerContext) -> Worker:
        """A worker that has accepted the call. One that died in the pool (its zygote was
        killed, say) is dropped and the next one tried."""
        frame = json.dumps(spec).encode()
        frame = len(frame).to_bytes(8, "little") + frame
        for _attempt in range(3):
            try:
                worker = await self.pool.take()
            except RuntimeError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            try:
                worker.ctrl.setblocking(False)
                await asyncio.get_running_loop().sock_sendall(worker.ctrl, frame)
                return worker
            except BaseException as exc:  # dead in the pool, or this call was cancelled
                worker.kill()
                worker.close()
                self.pool.release()
                if not isinstance(exc, OSError):
                    raise
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker accepted the call; retry")

    async def Signal(self, request: pb.SignalRequest, context) -> pb.SignalResponse:
        if not self._exists(request.sandbox):
            self.space.forget(request.sandbox)  # a destroy: its files are gone
        delivered = 0
        for call in list(self.running):
            if call.sandbox == request.sandbox:
                delivered += call.signal(request.signal or signal.SIGKILL)
        return pb.SignalResponse(delivered=delivered)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        alive = self.pool.proc is not None and self.pool.proc.poll() is None
        return pb.HealthResponse(
            ok=alive, version="1", running=len(self.running), ready=len(self.pool.ready)
        )

    # -- files -------------------------------------------------------------------------------

    def _host_path(self, sandbox: str, path: str) -> Path:
        """Where ``path`` (inside the sandbox, under /tmp) lives on the host."""
        root = self.files_root / sandbox / "files"
        if not _SANDBOX.match(sandbox) or not root.is_dir():
            raise FileNotFoundError(f"no sandbox {sandbox!r}")
        norm = os.path.normpath(path)
        if not path.startswith("/") or not norm.startswith("/tmp/") or norm != path.rstrip("/"):
            raise ValueError(
                f"{path!r}: fncall sandboxes hold files under /tmp only (absolute, normal paths)"
            )
        if norm.count("/") > MAX_DEPTH:
            raise ValueError(f"{path[:100]!r}...: at most {MAX_DEPTH} directories deep")
        return root / norm[len("/tmp/") :]

    async def ReadFile(self, request: pb.ReadFileRequest, context) -> pb.ReadFileResponse:
        try:
            host = self._host_path(request.sandbox, request.path)
            fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except FileNotFoundError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.path}: no such file")
        except OSError as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{request.path}: {exc.strerror}"
            )
        try:
            data = read_whole(fd, request.path, request.max_bytes)
        except errors.InvalidArgument as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.message)
        return pb.ReadFileResponse(data=data)

    async def WriteFile(self, request: pb.WriteFileRequest, context) -> pb.WriteFileResponse:
        try:
            host = self._host_path(request.sandbox, request.path)
            root = self.files_root / request.sandbox / "files"
            parents = [root / p for p in reversed(host.relative_to(root).parents[:-1])]
            for d in parents:
                if d.is_symlink() or (d.exists() and not d.is_dir()):
                    raise ValueError(f"{request.path}: a parent is not a directory")
            try:
                old = os.lstat(host)
            except FileNotFoundError:
                old = None
            if old is not None and not stat.S_ISREG(old.st_mode):
                raise ValueError(f"{request.path}: not a file")
            made = [d for d in parents if not d.exists()]
            new_cost = max(len(request.data), BLOCK)  # (a new file's blocks, as counted)
            self.space.charge(
                request.sandbox, new_cost + BLOCK * len(made) - (cost(old) if old else 0),
                len(made) + (old is None),
            )  # fmt: skip
            for d in made:
                d.mkdir()
                os.chown(d, 0, self.gid)
                os.chmod(d, 0o777)
            tmp = host.with_name(f".{host.name}.dsec-tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(request.data)
            mode = (request.mode or 0o644) & 0o777  # never setuid, setgid or sticky
            os.chown(tmp, 0, self.gid)
            os.chmod(tmp, mode | (mode & 0o700) >> 3)  # the sandbox group gets the owner's rights
            os.replace(tmp, host)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except errors.QuotaExceeded as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message,
                trailing_metadata=((ERROR_CODE_KEY, exc.code),),
            )  # fmt: skip
        except FileNotFoundError:  # (the message names the sandbox's path, never the host's)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.sandbox}")
        except OSError as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{request.path}: {exc.strerror}"
            )
        return pb.WriteFileResponse(size=len(request.data))


async def _run(worker: Worker, stdin: bytes, timeout: float, cap: int):
    """Stream the ExecEvents of the call ``worker`` has accepted, until it has exited."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, bytes | None]] = asyncio.Queue()
    kept = {"stdout": 0, "stderr": 0}
    state = {"truncated": False, "timed_out": False}

    def reader(fd: int, name: str) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(fd)
            queue.put_nowait((name, None))
            return
        room = cap - kept[name]
        if len(data) > room:
            state["truncated"] = True
            data = data[: max(room, 0)]
        if data:
            kept[name] += len(data)
            queue.put_nowait((name, data))

    # an argv call's status comes in the worker's report (sent before it exits); a python
    # call's (its worker closes the socket before the code runs), or a worker's that died,
    # is the wait status the zygote reads from the kernel
    report = asyncio.ensure_future(_read_report(worker.ctrl))

    def on_timeout() -> None:
        # a report is no proof: whatever was said, a worker still alive is killed, with
        # everything in its namespace and cgroup. One that had reported was on time.
        killed = worker.kill()
        state["timed_out"] = killed and not (report.done() and report.result())

    for fd, name in ((worker.stdout, "stdout"), (worker.stderr, "stderr")):
        loop.add_reader(fd, reader, fd, name)
    writer = asyncio.ensure_future(_feed(worker, stdin))
    started = time.monotonic()
    timer = loop.call_later(timeout, on_timeout)
    try:
        open_streams = 2
        while open_streams:
            name, data = await queue.get()
            if data is None:
                open_streams -= 1
            else:
                yield pb.ExecEvent(**{name: data})
        info = await report or await worker.exited
        duration = time.monotonic() - started
        code = -signal.SIGKILL if state["timed_out"] else os.waitstatus_to_exitcode(info["status"])
        yield pb.ExecEvent(
            exit=pb.ExecExit(
                exit_code=code,
                timed_out=state["timed_out"],
                truncated=state["truncated"],
                duration_s=duration,
                cpu_s=info["cpu_s"],
                max_rss_bytes=info["max_rss"],
            )
        )
    finally:
        timer.cancel()
        writer.cancel()
        report.cancel()
        if not worker.exited.done():
            worker.kill()
        for fd in (worker.stdout, worker.stderr):
            loop.remove_reader(fd)
        worker.close()


async def _read_report(ctrl: socket.socket) -> dict | None:
    """The worker's final frame: the call's wait status and resource use; None at the end of
    the stream (a python call, or a worker that died). No call's code holds the worker's end
    of ``ctrl``; a frame over 4 KiB is ignored."""
    loop = asyncio.get_running_loop()
    buf = bytearray()
    need = 8
    while len(buf) < need:
        try:
            chunk = await loop.sock_recv(ctrl, need - len(buf))
        except OSError:  # ECONNRESET: the worker was killed
            return None
        if not chunk:
            return None
        buf += chunk
        if need == 8 and len(buf) == 8:
            need = 8 + int.from_bytes(buf, "little")
            if need > 4096:
                return None
    try:
        info = json.loads(buf[8:])
        return {
            "status": int(info["status"]),
            "cpu_s": float(info["cpu_s"]),
            "max_rss": int(info["max_rss"]),
        }
    except (ValueError, KeyError, TypeError):
        return None


async def _feed(worker: Worker, data: bytes) -> None:
    """Write ``data`` to the call's stdin, then close it; a call that stops reading is fine."""
    loop = asyncio.get_running_loop()
    fd = worker.stdin
    try:
        if data:
            os.set_blocking(fd, False)
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    ready = loop.create_future()
                    loop.add_writer(fd, ready.set_result, None)
                    try:
                        await ready
                    finally:
                        loop.remove_writer(fd)
    except OSError:  # EPIPE: the call exited or closed its stdin
        pass
    finally:
        worker.close_stdin()


async def serve(cfg: SupervisorConfig) -> None:
    pool = Pool(cfg)
    pool.start()
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # calls the server has received but the event loop has not yet picked up: past
            # 1,000 gRPC cancels them at random (CANCELLED), all past 3,000. The one client is
            # the edge, whose batches may be larger; the calls queue fairly in TenantSlots.
            ("grpc.server.max_pending_requests", _MAX_PENDING),
            ("grpc.server.max_pending_requests_hard_limit", _MAX_PENDING),
        ]
    )
    add_AgentServicer_to_server(Agent(cfg, pool), server)
    if os.path.exists(cfg.socket):
        os.unlink(cfg.socket)
    target, _dir_fd = unix_target(cfg.socket)  # (the fd stays open while we serve)
    server.add_insecure_port(target)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=2)
        await pool.close()


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = SupervisorConfig.model_validate_json(sys.argv[1])
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
