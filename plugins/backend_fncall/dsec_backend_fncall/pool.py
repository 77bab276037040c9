"""The supervisor's pool: the zygote, the workers it made, and their cgroups.

``Pool.take()`` hands out one ready worker; the pool refills itself. Every worker is held by
its pidfd, and killed through it and through its cgroup2 slot (``cgroup.kill``), so a kill
reaches every process the call started whatever the call does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsec_backend_fncall.zygote import BOOT
from dsec_kernel.linuxhost.cgroups import Group, host_reserve, v1_controllers, v2_own
from dsec_kernel.linuxhost.procs import die_with_parent

if TYPE_CHECKING:
    from dsec_backend_fncall.supervisor import SupervisorConfig

__all__ = ["Pool", "Worker", "cgroup_base"]

log = logging.getLogger("dsec.fncall.supervisor")
#: the zygote's environment: nothing of the supervisor's (or the edge's) is passed on
ZYGOTE_ENV = {"PYTHONIOENCODING": "utf-8:backslashreplace", "LANG": "C.UTF-8"}
#: name of the cgroup2 "hierarchy" in :class:`~dsec_kernel.linuxhost.cgroups.Group` dirs
UNIFIED = "unified"


@dataclass
class Worker:
    """A ready worker: PID 1 of its namespaces, waiting for one call."""

    wid: int
    uid: int
    ctrl: socket.socket
    stdin: int
    stdout: int
    stderr: int
    pidfd: int
    kill_file: Path | None  # its cgroup2 slot's cgroup.kill
    exited: asyncio.Future[dict] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def alive(self) -> bool:
        """Whether PID 1 has not exited yet (a pidfd becomes readable when it has)."""
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return not p.poll(0)

    def kill(self) -> bool:
        """SIGKILL every process of the call: its cgroup (while PID 1 lives, the slot is still
        this worker's: a uid is reused only once its worker is reaped), then PID 1 by pidfd,
        which takes its PID namespace down. False if it had already exited."""
        if not self.alive():
            return False
        if self.kill_file is not None:
            try:
                self.kill_file.write_text("1")
            except OSError:
                pass  # the pidfd kill below still takes the namespace down
        return self.signal(signal.SIGKILL)

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to PID 1 (which passes the usual ones on to the call)."""
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
        self.urgent = 0  # of those, spawns at normal priority (a call waits for each)
        self.busy = 0
        self.live: dict[int, Worker] = {}
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.closing = False
        self.cgroup = cgroup_base() if cfg.cgroups else None
        self.kill_dir = self.cgroup.dirs.get(UNIFIED) if self.cgroup else None

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zcfg = {
            **self.cfg.model_dump(
                include={
                    "tmp_size_mb",
                    "uid_base",
                    "uid_count",
                    "view_paths",
                    "view_etc",
                    "keep",
                    "hide",
                    "bpf_hex",
                    "sys_path",
                    "hostname",
                    "loopback",
                    "files_root",
                }
            ),
            "cgroups": {c: str(d) for c, d in self.cgroup.dirs.items()} if self.cgroup else {},
            "supervisor_pid": os.getpid(),
        }
        parent.send(json.dumps(zcfg).encode())  # read first, by BOOT
        self.proc = subprocess.Popen(  # a session of its own, no terminal, cwd /
            [sys.executable, "-S", "-I", "-c", BOOT, str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env=ZYGOTE_ENV,
            cwd="/",
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGKILL),
        )
        child.close()
        parent.setblocking(False)
        self.sock = parent
        self.spawning = self.urgent = 0
        asyncio.get_running_loop().add_reader(parent.fileno(), self._on_message)
        self._refill()

    def _refill(self) -> None:
        """Top the pool up. While calls run and half the pool is still ready, wait: forking
        next to a running call slows it down, and the pool refills when calls finish."""
        if self.busy and len(self.ready) >= self.cfg.pool_size // 2 and not self.waiters:
            return
        want = self.cfg.pool_size + len(self.waiters)
        while self.sock is not None and (
            len(self.ready) + self.spawning < want or self.urgent < len(self.waiters)
        ):
            # a waiting call counts only on urgent spawns: one preparing at idle priority
            # may never run while other tenants' calls keep the CPU busy
            urgent = self.urgent < len(self.waiters)
            try:
                self.sock.send(b'{"op": "spawn", "urgent": true}' if urgent else b'{"op": "spawn"}')
            except OSError:  # the zygote is gone; _on_message sees the end and restarts it
                return
            self.spawning += 1
            self.urgent += urgent

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
            self.urgent -= msg.get("urgent", False)
            ctrl, stdin, stdout, stderr, pidfd = fds
            for fd in (stdout, stderr):
                os.set_blocking(fd, False)
            uid = msg["uid"]
            w = Worker(
                msg["wid"],
                uid,
                socket.socket(fileno=ctrl),
                stdin,
                stdout,
                stderr,
                pidfd,
                self.kill_dir / str(uid) / "cgroup.kill" if self.kill_dir else None,
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
            self.urgent -= msg.get("urgent", False)
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


def cgroup_base() -> Group | None:
    """This supervisor's cgroup ``dsec-fncall-<pid>``: in the memory and pids hierarchies
    (cgroup v1, both or neither) for the calls' limits, and in cgroup2 (when mounted, with
    ``cgroup.kill``: Linux 5.14+) to kill a call whole. Those of supervisors that died
    without cleaning up are removed first. None when there is neither."""
    parents = {c: d for c, d in v1_controllers().items() if c in ("memory", "pids")}
    if len(parents) < 2:
        log.warning("no cgroup v1 memory and pids hierarchies: calls are limited by rlimits only")
        parents = {}
    if (cpu := v1_controllers().get("cpu")) is not None:  # tenants' groups, made by calls
        parents["cpu"] = cpu
    if (own2 := v2_own()) is not None:
        parents[UNIFIED] = own2
    for name in {p.name for d in parents.values() for p in d.glob("dsec-fncall-*")}:
        pid = name.rsplit("-", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            Group.under(parents, name).remove()
    group = Group.under(parents, f"dsec-fncall-{os.getpid()}")
    try:
        group.create()
        memory, processes = host_reserve()  # every call together: the host keeps some
        if "memory" in group.dirs:  # slots inherit it: swap never stretches a call's memory
            group.set("memory", "memory.swappiness", 0)  # limit (a node may swap for pauses)
            group.set("memory", "memory.limit_in_bytes", memory)
        if "pids" in group.dirs:
            group.set("pids", "pids.max", processes)
    except OSError as exc:
        log.warning("cannot create cgroups (%s): calls are limited by rlimits only", exc)
        group.remove()
        return None
    if UNIFIED in group.dirs and not (group.dirs[UNIFIED] / "cgroup.kill").exists():
        log.warning("no cgroup.kill (Linux 5.14+): a call is killed through its PID 1 only")
        Group({UNIFIED: group.dirs.pop(UNIFIED)}).remove()
    return group if group.dirs else None
