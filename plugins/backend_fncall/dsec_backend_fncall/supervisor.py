"""The fncall supervisor: serves the kernel's agent protocol for the warm pool.

``python -m dsec_backend_fncall.supervisor CONFIG_JSON`` (started by the edge's fncall backend).
It starts the zygote (:mod:`dsec_backend_fncall.zygote`), keeps ``pool_size`` workers ready,
and serves ``Agent`` on a unix socket: each Exec takes one fresh worker, streams its output
and reports its exit; the worker is never reused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field

from dsec_backend_fncall.zygote import BOOT
from dsec_kernel import errors
from dsec_kernel.agent import agent_pb2 as pb
from dsec_kernel.agent.agent_pb2_grpc import AgentServicer, add_AgentServicer_to_server
from dsec_kernel.agent.client import unix_target
from dsec_kernel.cgroups import Group, v1_controllers
from dsec_kernel.fileio import read_whole
from dsec_kernel.procs import die_with_parent
from dsec_kernel.wire import SANDBOX_ID_PATTERN

__all__ = ["Pool", "SupervisorConfig", "main"]

log = logging.getLogger("dsec.fncall.supervisor")

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
}
LANGUAGES = {"python": None, "bash": ["/bin/bash", "-c"]}
_SANDBOX = re.compile(SANDBOX_ID_PATTERN)


class SupervisorConfig(BaseModel):
    """Everything the supervisor and its zygote need (the backend fills it in)."""

    model_config = ConfigDict(extra="forbid")

    socket: str
    files_root: str
    pool_size: int = Field(8, ge=1)
    max_running: int = Field(64, ge=1)
    tmp_size_mb: int = Field(64, ge=1)
    memory_mb: int = Field(512, ge=32)
    processes: int = Field(64, ge=1)
    file_size_mb: int = Field(64, ge=1)
    open_files: int = Field(1024, ge=16)
    uid_base: int = Field(200_000, ge=1000)
    uid_count: int = Field(4096, ge=16)
    masks: list[str]
    keep: list[str]
    bpf_hex: str
    sys_path: list[str]
    hostname: str = "sandbox"
    loopback: bool = False
    cgroups: bool = True


@dataclass
class Worker:
    """A ready worker: PID 1 of its namespaces, waiting for one call."""

    wid: int
    pid: int
    uid: int
    ctrl: socket.socket
    stdin: int
    stdout: int
    stderr: int
    pidfd: int
    exited: asyncio.Future[dict] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def kill(self, sig: int = signal.SIGKILL) -> bool:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
            return True
        except ProcessLookupError:
            return False

    def close_stdin(self) -> None:
        if self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def close(self) -> None:
        """Close every descriptor held for this worker (each exactly once)."""
        self.ctrl.close()
        self.close_stdin()
        for fd in (self.stdout, self.stderr, self.pidfd):
            os.close(fd)


class Pool:
    """The zygote and the workers it made: ``take()`` one, the pool refills itself."""

    def __init__(self, cfg: SupervisorConfig) -> None:
        self.cfg = cfg
        self.ready: deque[Worker] = deque()
        self.waiters: deque[asyncio.Future[Worker]] = deque()
        self.spawning = 0
        self.busy = 0
        self.live: dict[int, Worker] = {}
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.closing = False
        self.cgroup = _cgroup_base() if cfg.cgroups else None

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zcfg = {
            **self.cfg.model_dump(
                include={
                    "tmp_size_mb",
                    "uid_base",
                    "uid_count",
                    "masks",
                    "keep",
                    "bpf_hex",
                    "sys_path",
                    "hostname",
                    "loopback",
                }
            ),
            "files_root": self.cfg.files_root,
            "cgroups": {c: str(d) for c, d in self.cgroup.dirs.items()} if self.cgroup else {},
            "sock_fd": child.fileno(),
            "supervisor_pid": os.getpid(),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-I", "-c", BOOT, json.dumps(zcfg)],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env={"PYTHONIOENCODING": "utf-8:backslashreplace", "LANG": "C.UTF-8"},
            preexec_fn=lambda: die_with_parent(signal.SIGKILL),
        )
        child.close()
        parent.setblocking(False)
        self.sock = parent
        self.spawning = 0
        asyncio.get_running_loop().add_reader(parent.fileno(), self._on_message)
        self._refill()

    def _refill(self) -> None:
        """Top the pool up. While calls run and half the pool is still ready, wait: forking
        next to a running call slows it down, and the pool refills when calls finish."""
        if self.busy and len(self.ready) >= self.cfg.pool_size // 2 and not self.waiters:
            return
        want = self.cfg.pool_size + len(self.waiters)
        while self.sock is not None and len(self.ready) + self.spawning < want:
            urgent = self.spawning < len(self.waiters)
            try:
                self.sock.send(b'{"op": "spawn", "urgent": true}' if urgent else b'{"op": "spawn"}')
            except OSError:  # the zygote is gone; _on_message sees the end and restarts it
                return
            self.spawning += 1

    def release(self) -> None:
        """A worker taken with :meth:`take` has finished its call."""
        self.busy -= 1
        self._refill()

    async def take(self) -> Worker:
        if self.ready:
            w = self.ready.popleft()
        else:
            fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            self._refill()
            try:
                w = await fut
            except asyncio.CancelledError:
                if fut in self.waiters:
                    self.waiters.remove(fut)
                elif fut.done() and not fut.cancelled():
                    self.ready.appendleft(fut.result())
                raise
        self.busy += 1
        self._refill()
        return w

    def _on_message(self) -> None:
        assert self.sock is not None
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, 8)
        except BlockingIOError:
            return
        except OSError:  # ECONNRESET: it died with our requests unread
            data, fds = b"", []
        if not data:
            self._zygote_died()
            return
        msg = json.loads(data)
        op = msg["op"]
        if op == "ready":
            self.spawning -= 1
            ctrl, stdin, stdout, stderr, pidfd = fds
            for fd in (stdout, stderr):
                os.set_blocking(fd, False)
            w = Worker(
                msg["wid"],
                msg["pid"],
                msg["uid"],
                socket.socket(fileno=ctrl),
                stdin,
                stdout,
                stderr,
                pidfd,
            )
            self.live[w.wid] = w
            while self.waiters:
                fut = self.waiters.popleft()
                if not fut.done():
                    fut.set_result(w)
                    return
            self.ready.append(w)
        elif op == "exit":
            w = self.live.pop(msg["wid"], None)
            if w is not None and not w.exited.done():
                w.exited.set_result(msg)
        elif op == "error":
            self.spawning -= 1
            log.error("zygote: %s", msg["message"])
            self._fail_waiters(msg["message"], 1)

    def _fail_waiters(self, reason: str, count: int) -> None:
        while count and self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(RuntimeError(reason))
                count -= 1

    def _zygote_died(self) -> None:
        """Every worker died with it (PDEATHSIG): fail what waits, start a new zygote."""
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.sock = None
        for w in self.live.values():
            if not w.exited.done():
                w.exited.set_result({"status": signal.SIGKILL, "cpu_s": 0.0, "max_rss": 0})
        self.live.clear()
        for w in self.ready:
            w.close()
        self.ready.clear()
        self._fail_waiters("the zygote died", len(self.waiters))
        if self.proc is not None:
            self.proc.wait()
        if not self.closing:  # (the next zygote's workers reuse the cgroup slots)
            log.error(
                "the zygote exited (%s); starting a new one", self.proc and self.proc.returncode
            )
            loop.call_later(0.2, self.start)

    async def close(self) -> None:
        self.closing = True
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        for w in self.ready:
            w.close()
        if self.proc is not None:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)


def _cgroup_base() -> Group | None:
    """This supervisor's memory+pids cgroup (``dsec-fncall-<pid>``), after removing those
    of supervisors that died without cleaning up. None when the host has no such v1 ones."""
    parents = {c: d for c, d in v1_controllers().items() if c in ("memory", "pids")}
    if len(parents) < 2:
        log.warning("no cgroup v1 memory and pids hierarchies: calls are limited by rlimits only")
        return None
    for stale in parents["memory"].glob("dsec-fncall-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            Group.under(parents, stale.name).remove()
    try:
        group = Group.under(parents, f"dsec-fncall-{os.getpid()}").create()
        group.set("memory", "memory.swappiness", 0)  # slots inherit it: swap never stretches
        return group  # a call's memory limit (a node may have swap for paused sandboxes)
    except OSError as exc:
        log.warning("cannot create cgroups (%s): calls are limited by rlimits only", exc)
        return None


@dataclass
class _Call:
    sandbox: str
    exec_id: str
    worker: Worker


class Agent(AgentServicer):
    """The agent protocol over the pool. A sandbox's files live in ``files_root/<id>/files/``,
    which calls see as their /tmp. Files belong to root and the sandbox group (every call's
    group), which gets the owner's permission bits."""

    def __init__(self, cfg: SupervisorConfig, pool: Pool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.slots = asyncio.Semaphore(cfg.max_running)
        self.running: dict[int, _Call] = {}
        self.files_root = Path(cfg.files_root)
        self.gid = cfg.uid_base - 1

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
        lim = req.limits
        return {
            "mode": mode,
            "code": req.code if mode == "python" else "",
            "argv": argv,
            "env": {**DEFAULT_ENV, **dict(req.env)},
            "cwd": req.cwd or "/tmp",
            "sandbox": req.sandbox,
            "limits": {
                "memory_bytes": lim.memory_bytes or self.cfg.memory_mb << 20,
                "processes": lim.processes or self.cfg.processes,
                "file_size_bytes": lim.file_size_bytes or self.cfg.file_size_mb << 20,
                "open_files": lim.open_files or self.cfg.open_files,
                "cpu_seconds": math.ceil(req.timeout_s) + 1,
            },
        }

    async def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext):
        try:
            spec = self._spec(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.sandbox and not (self.files_root / request.sandbox / "files").is_dir():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.sandbox}")
        async with self.slots:
            worker = await self._hand_over(spec, context)
            self.running[worker.wid] = _Call(request.sandbox, request.exec_id, worker)
            try:
                async for event in _run(
                    worker, request.stdin, request.timeout_s, request.max_output_bytes
                ):
                    yield event
            finally:
                self.running.pop(worker.wid, None)
                self.pool.release()

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
        delivered = 0
        for call in list(self.running.values()):
            if (request.exec_id and call.exec_id == request.exec_id) or (
                not request.exec_id and call.sandbox == request.sandbox
            ):
                delivered += call.worker.kill(request.signal or signal.SIGKILL)
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
            for parent in reversed(host.relative_to(root).parents[:-1]):
                d = root / parent
                if d.is_symlink() or (d.exists() and not d.is_dir()):
                    raise ValueError(f"{request.path}: a parent is not a directory")
                if not d.exists():
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
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
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

    # the worker's own report (sent before it exits) has the program's status; without one
    # (it was killed, or died), the zygote's wait status of the worker stands
    report = asyncio.ensure_future(_read_report(worker.ctrl))

    def on_timeout() -> None:
        if not (report.done() and report.result()):  # not a call that has just finished
            state["timed_out"] = worker.kill()

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
    """The worker's final frame: its wait status and resource use (None if it died first).

    In python mode the call's own code could write it: it can only misreport its own
    result, and a frame over 4 KiB is ignored.
    """
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
