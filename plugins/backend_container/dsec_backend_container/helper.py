"""The native helper (``csrc/dsec-sandbox.c``): built on first use, then started per sandbox
(``init``) and per command (``exec``). Commands' output is read event-driven, capped, and
their process group is killed at the timeout."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dsec_kernel import errors
from dsec_kernel.wire import ExecResult

__all__ = ["Helper", "compiler"]

SOURCE = Path(__file__).parent / "csrc" / "dsec-sandbox.c"
#: after a command ends, how long output still in flight is waited for
_DRAIN_S = 0.2


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


class Helper:
    """The built helper binary, kept under ``bin_dir`` by the hash of its source."""

    def __init__(self, bin_dir: Path) -> None:
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        self.path = bin_dir / f"dsec-sandbox-{digest}"
        if not self.path.exists():
            self._build(bin_dir)

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
        rootfs: Path,
        lowers: list[Path],
        upper: Path,
        work: Path,
        hostname: str,
        cgroups: list[Path],
        netns: Path | None = None,
    ) -> int:
        """Start a sandbox's init; returns its host PID. Raises Unavailable with the reason."""
        argv = [
            str(self.path), "init", "--rootfs", str(rootfs),
            "--lower", ":".join(str(p) for p in lowers),
            "--upper", str(upper), "--work", str(work), "--hostname", hostname,
        ]  # fmt: skip
        for cg in cgroups:
            argv += ["--cgroup", str(cg)]
        if netns is not None:
            argv += ["--netns", str(netns)]
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise errors.Unavailable(f"the sandbox did not start: {proc.stderr.strip()}")
        return int(proc.stdout)

    async def exec(
        self,
        init_pid: int,
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
        uid: int | None = None,
        gid: int | None = None,
        file_size: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the sandbox of ``init_pid``; see Backend.exec for the contract.
        ``kill_all`` (called in a thread) kills the command with everything it started, on
        timeout or cancellation.

        Raises SandboxLost if the sandbox cannot be entered (its init is gone)."""
        cmd = [str(self.path), "exec", "--pid", str(init_pid), "--cwd", cwd]
        for cg in cgroups:
            cmd += ["--cgroup", str(cg)]
        if uid is not None:
            cmd += ["--uid", str(uid), "--gid", str(gid if gid is not None else uid)]
        if seccomp is not None:
            cmd += ["--seccomp", str(seccomp)]
        if file_size is not None:
            cmd += ["--fsize", str(file_size)]
        status_r, status_w = os.pipe()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        cmd += ["--status-fd", str(status_w), "--", *argv]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                cmd, stdin=in_r, stdout=out_w, stderr=err_w, env=env, pass_fds=(status_w,)
            )
        finally:
            for fd in (status_w, in_r, out_w, err_w):
                os.close(fd)
        run = _Run(proc, status_r, in_w, out_r, err_r, max_output, kill_all)
        try:
            return await run.finish(stdin, timeout, started)
        finally:
            run.close()


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
        finally:
            group = self._field("pid")  # in case kill_all failed: the process group at least
            if group is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            self.proc.kill()

    async def finish(self, stdin: bytes, timeout: float, started: float) -> ExecResult:
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
        if status is None and not timed_out:
            err = bytes(self.bufs[self.err]).decode(errors="replace").strip()
            raise errors.SandboxLost(f"cannot run the command in the sandbox: {err}")
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
