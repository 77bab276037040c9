"""Sandboxes' inits, held by pidfd.

A PID names whatever process has it now: once a sandbox's init is gone, its number may be a
host process a moment later. Everything that reaches a sandbox goes through its init's pidfd
instead (``setns(pidfd, ...)`` in the helper), which can never name another process: a dead
init makes every operation fail as "lost", never act elsewhere. The event loop watches each
pidfd, so an init that dies (killed from the host, crashed) is noticed at once.
"""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable

from dsec_kernel.contract import errors

__all__ = ["Inits", "exited", "process_start"]


def process_start(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def exited(pidfd: int, timeout: float = 0.0) -> bool:
    """Whether the process of ``pidfd`` has exited (waiting up to ``timeout`` seconds). poll,
    not select: a node's thousands of pidfds are past select's 1024."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


class Inits:
    """sandbox id -> its init's pidfd. ``on_exit(sandbox_id)`` is called on the event loop
    when a watched init exits by itself."""

    def __init__(self, on_exit: Callable[[str], None]) -> None:
        self.on_exit = on_exit
        self._fds: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, sandbox_id: str, pidfd: int) -> None:
        """Hold ``pidfd`` (now ours to close) for the sandbox. Call on the event loop."""
        self._loop = asyncio.get_running_loop()
        self.drop(sandbox_id)
        self._fds[sandbox_id] = pidfd
        self._loop.add_reader(pidfd, self._gone, sandbox_id, pidfd)

    @staticmethod
    def open(pid: int, start: int) -> int | None:
        """A pidfd of process ``pid`` if it is still the one that started at ``start`` (an
        init recorded before a restart); None if it is gone or the pid was reused."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        # the pidfd names whoever had the pid when opened: if that is not our init, its
        # start time differs; if our init died after, the pidfd says so
        if process_start(pid) != start or exited(fd):
            os.close(fd)
            return None
        return fd

    def _gone(self, sandbox_id: str, pidfd: int) -> None:
        if self._fds.get(sandbox_id) == pidfd:
            self.drop(sandbox_id)
            self.on_exit(sandbox_id)

    def pidfd(self, sandbox_id: str) -> int:
        """The init's pidfd; SandboxLost if it is not held (the init is gone)."""
        fd = self._fds.get(sandbox_id)
        if fd is None or exited(fd):
            raise errors.SandboxLost(
                f"sandbox {sandbox_id} is lost: its init ended; destroy it and create another"
            )
        return fd

    def alive(self, sandbox_id: str) -> bool:
        fd = self._fds.get(sandbox_id)
        return fd is not None and not exited(fd)

    def take(self, sandbox_id: str) -> int | None:
        """Stop watching and hand over the pidfd (the caller closes it), e.g. to kill the
        init on purpose. Call on the event loop."""
        fd = self._fds.pop(sandbox_id, None)
        if fd is not None and self._loop is not None:
            self._loop.remove_reader(fd)
        return fd

    def drop(self, sandbox_id: str) -> None:
        fd = self.take(sandbox_id)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for sandbox_id in list(self._fds):
            self.drop(sandbox_id)
