"""The native helper (``csrc/dsec-sandbox.c``): built on first use, then started per sandbox
(``init``), per command (``exec``) and per file operation (``read``, ``write``), always with
an empty environment. Commands' output is read event-driven, capped, and everything a
command started is killed at its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import MAX_FILE_BYTES, ExecResult

__all__ = ["Helper", "compiler"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "dsec-sandbox.c"
#: uids (and gids) of a sandbox's user namespace
UID_COUNT = 1 << 16
#: after a command ends, how long output still in flight is waited for
_DRAIN_S = 0.2
#: after a kill, how long the helper may take to report before it is killed too
_KILL_WAIT_S = 5.0


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


class Helper:
    """The built helper binary, kept under ``bin_dir`` by the hash of its source, and run
    from a sealed in-memory copy of it: its processes' ``/proc/<pid>/maps`` and ``exe``, which
    a file operation aimed at ``/proc/self/maps`` shows the sandbox, then name
    ``/memfd:dsec-sandbox``, not a path of the host. The copy's pages are shared by every
    process that runs it, as the file's were. :meth:`close` drops this process's copy
    (processes running it keep theirs)."""

    def __init__(self, bin_dir: Path, file_timeout_s: float = 30.0) -> None:
        self.file_timeout_s = file_timeout_s
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        self.path = bin_dir / f"dsec-sandbox-{digest}"
        if not self.path.exists():
            self._build(bin_dir)
        self._image = _sealed_copy(self.path)
        # the edge's own descriptor, close-on-exec: no helper inherits it
        self.exe = f"/proc/{os.getpid()}/fd/{self._image}"

    def close(self) -> None:
        if self._image >= 0:
            os.close(self._image)
            self._image = -1

    def _build(self, bin_dir: Path) -> None:
        cc = compiler()
        if cc is None:
            raise errors.Unavailable(
                "no C compiler to build the container helper: apt-get install gcc"
            )
        bin_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        proc = subprocess.run(
            [cc, "-O2", "-static", "-no-pie", "-Wall", "-o", str(tmp), str(SOURCE)],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:  # a libc without static archives: link dynamically
            proc = subprocess.run(
                [cc, "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True
            )
        if proc.returncode != 0:
            raise errors.Unavailable(f"building the container helper failed:\n{proc.stderr}")
        os.sync()  # its pages then stay clean and shared by every sandbox's init
        tmp.replace(self.path)

    def start_init(
        self,
        sandbox_dir: Path,
        lowers: list[Path],
        uid_base: int,
        hostname: str,
        cgroups: list[Path],
        netns: Path | None = None,
    ) -> tuple[int, int]:
        """Start a sandbox's init in ``sandbox_dir`` (see the source's header for its
        layout); returns its host PID and a pidfd of it. Raises Unavailable (the reason goes
        to the edge's log: it names host paths)."""
        argv = [
            self.exe, "init", "--dir", str(sandbox_dir),
            "--lower", ":".join(str(p) for p in lowers),
            "--uid-base", str(uid_base), "--uid-count", str(UID_COUNT), "--hostname", hostname,
        ]  # fmt: skip
        for cg in cgroups:
            argv += ["--cgroup", str(cg)]
        if netns is not None:
            argv += ["--netns", str(netns)]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            argv += ["--ready-fd", str(theirs.fileno())]
            proc = subprocess.run(
                argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env={},
                pass_fds=(theirs.fileno(),),
            )  # fmt: skip
            if proc.returncode != 0:  # the reason names host paths: for the edge's log only
                log.warning("a sandbox did not start: %s", proc.stderr.strip())
                raise errors.Unavailable("the sandbox did not start on this node; retry")
            theirs.close()
            msg, fds, _flags, _addr = socket.recv_fds(ours, 64, 1)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise errors.Unavailable("the sandbox's init did not report")
        return int(msg), fds[0]

    async def exec(
        self,
        pidfd: int,
        argv: list[str],
        *,
        cgroups: list[Path],
        kill_all: Callable[[], None],
        env: dict[str, str],
        cwd: str,
        stdin: bytes,
        timeout: float,
        max_output: int,
        seccomp: Path | None,
        user: str | None = None,
        file_size: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the sandbox of the init ``pidfd``; see Backend.exec for the
        contract. ``user``: a name (looked up in the sandbox) or digits (uid = gid).
        ``kill_all`` (called in a thread) kills the command with everything it started, on
        timeout or cancellation.

        Raises SandboxLost if the sandbox is gone, InvalidArgument for an unknown user."""
        cmd = [self.exe, "exec", "--pidfd", str(pidfd), "--cwd", cwd]
        for cg in cgroups:
            cmd += ["--cgroup", str(cg)]
        if user is not None and user.isdigit():
            cmd += ["--uid", user, "--gid", user]
        elif user is not None:
            cmd += ["--user", user]
        if seccomp is not None:
            cmd += ["--seccomp", str(seccomp)]
        if file_size is not None:
            cmd += ["--fsize", str(file_size)]
        # applied only once inside: the helper's own environment is empty
        env_fd = _memfd(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
        status_r, status_w = os.pipe()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        cmd += ["--status-fd", str(status_w), "--env-fd", str(env_fd), "--", *argv]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                cmd, stdin=in_r, stdout=out_w, stderr=err_w, env={},
                pass_fds=(status_w, env_fd, pidfd),
            )  # fmt: skip
        finally:
            for fd in (status_w, in_r, out_w, err_w, env_fd):
                os.close(fd)
        run = _Run(proc, status_r, in_w, out_r, err_r, max_output, kill_all)
        try:
            return await run.finish(stdin, timeout, started, user)
        finally:
            run.close()

    async def read_file(self, pidfd: int, path: str, max_bytes: int, cgroups: list[Path]) -> bytes:
        """The whole regular file ``path`` of the sandbox, read as its root inside it, in
        ``cgroups`` (the sandbox's: its CPU, memory and processes are charged)."""
        argv = [self.exe, "read", "--pidfd", str(pidfd), *_cgroup_args(cgroups),
                "--max", str(max_bytes), path]  # fmt: skip
        return await _file_op(argv, pidfd, b"", path, self.file_timeout_s)

    async def write_file(
        self, pidfd: int, path: str, data: bytes, mode: int, cgroups: list[Path]
    ) -> None:
        """Replace ``path`` in the sandbox atomically, as its root inside it, in ``cgroups``."""
        argv = [self.exe, "write", "--pidfd", str(pidfd), *_cgroup_args(cgroups),
                "--mode", str(mode), "--size", str(len(data)), path]  # fmt: skip
        await _file_op(argv, pidfd, data, path, self.file_timeout_s)


def _sealed_copy(path: Path) -> int:
    """A close-on-exec memfd holding ``path``'s bytes, sealed against any change."""
    fd = _memfd(path.read_bytes(), "dsec-sandbox", os.MFD_ALLOW_SEALING)
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _cgroup_args(cgroups: list[Path]) -> list[str]:
    return [arg for cg in cgroups for arg in ("--cgroup", str(cg))]


def _memfd(data: bytes, name: str = "dsec", flags: int = 0) -> int:
    """A memory file holding ``data``, read from its start: what a helper reads as its
    environment or a file's new content (no pipe to feed while the helper may exit)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | flags)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


#: errno of a failed file operation -> the error a tenant gets
_FILE_ERRORS = {errno.ENOENT: errors.NotFound, errno.ENOTDIR: errors.NotFound}


async def _file_op(argv: list[str], pidfd: int, data: bytes, path: str, timeout: float) -> bytes:
    """Run a file helper; past ``timeout`` it is stopped (it kills its child in the sandbox),
    as when the caller stops waiting."""
    source = _memfd(data)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=source, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={}, pass_fds=(pidfd,),
        )  # fmt: skip
    finally:
        os.close(source)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()  # the helper SIGKILLs its child in the sandbox, then exits
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), _KILL_WAIT_S)
        except TimeoutError:
            proc.kill()
            await asyncio.shield(proc.wait())
        if isinstance(exc, TimeoutError):
            raise errors.DeadlineExceeded(
                f"{path}: the file operation took over {timeout:g} s (are the "
                "sandbox's processes stopped?); retry"
            ) from None
        raise
    if proc.returncode == 0:
        return out
    text = err.decode(errors="replace").strip()
    if proc.returncode == 3 or text == "lost":
        raise errors.SandboxLost("the sandbox is lost: its init ended; destroy it")
    word = text.split()
    if proc.returncode == 2 and len(word) >= 2 and word[0] == "error" and word[1].isdigit():
        code = int(word[1])
        if code in (errno.EDQUOT, errno.ENOSPC):
            raise errors.QuotaExceeded(
                f"{path}: the sandbox's disk is full (Limits.disk_mb or Limits.inodes, or "
                "all its tenant may fill on the node); delete files in it or in the tenant's "
                "other sandboxes, or create it with larger limits"
            )
        cls = _FILE_ERRORS.get(code, errors.InvalidArgument)
        reason = {errno.EFBIG: f"larger than {MAX_FILE_BYTES} bytes",
                  errno.EINVAL: "not a regular file"}.get(code, os.strerror(code))  # fmt: skip
        raise cls(f"{path}: {reason}")
    log.warning("file operation on %s failed: %s", path, text)
    raise errors.Unavailable(f"{path}: the file operation failed; retry")


class _Run:
    """One command's pipes, read and written without polling (event loop readers)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        status: int,
        stdin: int,
        out: int,
        err: int,
        cap: int,
        kill_all: Callable[[], None],
    ) -> None:
        self.proc, self.status_fd, self.stdin, self.cap = proc, status, stdin, cap
        self.kill_all = kill_all
        self.bufs = {out: bytearray(), err: bytearray(), status: bytearray()}
        self.out, self.err = out, err
        self.truncated = False
        self.loop = asyncio.get_running_loop()
        self.ended = self.loop.create_future()  # the status line arrived, or the helper died
        self.outputs_closed = self.loop.create_future()
        self.open: set[int] = set()
        for fd in (out, err, status):
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._read, fd)
            self.open.add(fd)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.loop.remove_reader(fd)
            self.open.discard(fd)
            if fd == self.status_fd and not self.ended.done():
                self.ended.set_result(None)
            if not self.open & {self.out, self.err} and not self.outputs_closed.done():
                self.outputs_closed.set_result(None)
            return
        buf = self.bufs[fd]
        if fd == self.status_fd:
            buf += data
            if b"status " in buf and buf.endswith(b"\n") and not self.ended.done():
                self.ended.set_result(None)
            return
        room = self.cap - len(buf)
        if len(data) > room:
            self.truncated = True
        buf += data[: max(room, 0)]

    def _field(self, key: str) -> int | None:
        for line in self.bufs[self.status_fd].decode().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().lstrip("-").isdigit():
                return int(value)
        return None

    async def _feed(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            os.set_blocking(self.stdin, False)
            while view:
                try:
                    view = view[os.write(self.stdin, view) :]
                except BlockingIOError:
                    ready = self.loop.create_future()
                    self.loop.add_writer(self.stdin, ready.set_result, None)
                    try:
                        await ready
                    finally:
                        self.loop.remove_writer(self.stdin)
        except OSError:  # the command closed its stdin or ended
            pass
        finally:
            os.close(self.stdin)
            self.stdin = -1

    async def _kill(self) -> None:
        try:
            await asyncio.to_thread(self.kill_all)
        finally:  # in case kill_all failed: the helper kills the command's group at least
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)  # our child: its pid is not reused
            try:
                await asyncio.wait_for(asyncio.shield(self.ended), _KILL_WAIT_S)
            except TimeoutError:
                self.proc.kill()

    async def finish(
        self, stdin: bytes, timeout: float, started: float, user: str | None
    ) -> ExecResult:
        feeder = asyncio.ensure_future(self._feed(stdin))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(self.ended), timeout)
        except TimeoutError:
            timed_out = True
            await self._kill()
            await self.ended
        except BaseException:  # cancelled: leave nothing running
            await asyncio.shield(self._kill())
            raise
        finally:
            feeder.cancel()
        # the command has ended: take the output still in flight, but a process it left in
        # the background holding the pipes open does not hold up the answer
        try:
            await asyncio.wait_for(asyncio.shield(self.outputs_closed), _DRAIN_S)
        except TimeoutError:
            pass
        status = self._field("status")
        said = self.bufs[self.status_fd].decode(errors="replace").split()
        if "lost" in said:
            raise errors.SandboxLost("the sandbox is lost: its init ended; destroy it")
        if "nouser" in said:
            raise errors.InvalidArgument(f"no user {user!r} in the sandbox's /etc/passwd")
        if status is None and not timed_out:
            err = bytes(self.bufs[self.err]).decode(errors="replace").strip()
            log.warning("a command could not start in a sandbox: %s", err)
            raise errors.Unavailable("the command could not start in the sandbox; retry")
        return ExecResult(
            stdout=bytes(self.bufs[self.out]),
            stderr=bytes(self.bufs[self.err]),
            exit_code=-signal.SIGKILL if timed_out else os.waitstatus_to_exitcode(status),
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
            truncated=self.truncated,
        )

    def close(self) -> None:
        for fd in list(self.open):
            self.loop.remove_reader(fd)
        for fd in (self.out, self.err, self.status_fd, self.stdin):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            self.proc.wait(timeout=5)  # the helper exits right after reporting
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
