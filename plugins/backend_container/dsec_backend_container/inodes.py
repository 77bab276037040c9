"""Inode limits of sandboxes' writable layers (``Limits.inodes``).

btrfs has no inode quota (and this kernel no ext4 or XFS quotas; a filesystem per sandbox
would cost ~7 ms and ~140 KiB each), so :class:`InodeLimits` holds each sandbox to its limit
from outside: every ``check`` it finds the highest inode number in use in the sandbox's
subvolume (a few tree searches, microseconds). btrfs numbers a subvolume's inodes upwards and
never reuses a number while mounted, so the count at the last look plus the numbers given out
since bounds the count now; only when that bound passes the limit are the inodes counted
(~1 µs each: 1.5 s for a million). A sandbox at its limit has its disk quota closed (qgroup
limit of one byte: whatever needs room fails inside with ``EDQUOT``, "Disk quota exceeded";
deleting works) until it is back under, then reopened. Between two looks a sandbox can
overshoot by what it creates in one interval (about 40,000 empty files a second on the
development VM). A closed sandbox is counted again at every look at first, then ever more
rarely while it stays over (at most every :data:`MAX_SKIP` looks). And all counting together
gets at most :data:`SHARE` of a core over time (a token bucket): a tenant keeping its
sandboxes just under their limits, which would have them counted at every look, makes them be
counted less often, least recently counted first, and overshoot by more, rather than keep this busy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dsec_backend_container.upperfs import UpperFs

__all__ = ["Change", "InodeLimits"]

log = logging.getLogger(__name__)
_ROOT_INODE = 256
#: the quota of a sandbox past its inode limit: no room for anything new
_CLOSED = 1
#: most looks skipped between two counts of a sandbox that stays over its limit
MAX_SKIP = 15
#: the part of a core counting may use, over time; and the most it may save up (seconds)
SHARE = 0.1
BURST_S = 2.0


@dataclass
class _Watched:
    rw: Path
    limit: int
    disk_bytes: int
    count: int = 1  # at the last count (an empty subvolume: its root)
    high: int = _ROOT_INODE  # the highest inode number in use then
    closed: bool | None = False  # None: not known (adopted after a restart)
    skip: int = 0  # looks to skip before counting again (closed and still over)
    backoff: int = 0
    counted_at: float = 0.0  # monotonic


@dataclass(frozen=True)
class Change:
    """A sandbox whose quota :meth:`InodeLimits.check` closed (``closed``) or reopened."""

    sandbox_id: str
    inodes: int
    limit: int
    closed: bool


class InodeLimits:
    """The inode limits of the sandboxes on ``fs``."""

    def __init__(self, fs: UpperFs, share: float = SHARE, burst_s: float = BURST_S) -> None:
        self.fs = fs
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self.share, self.burst_s = share, burst_s
        self.counted_s = 0.0  # all counting so far
        self._tokens = burst_s  # seconds of counting allowed now
        self._filled = time.monotonic()

    def watch(self, sandbox_id: str, rw: Path, limit: int, disk_bytes: int, known: bool) -> None:
        """Hold the sandbox whose writable layer is the subvolume ``rw`` to ``limit`` inodes
        (its byte quota is ``disk_bytes``). ``known``: ``rw`` was just made empty (create,
        restore); otherwise (adopted after a restart) it is counted at the next check and
        its quota set from the count."""
        entry = _Watched(rw, limit, disk_bytes, closed=False if known else None)
        with self._lock:
            self._watched[sandbox_id] = entry

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._watched.pop(sandbox_id, None)

    def check(self) -> list[Change]:
        """Look at every sandbox once (blocking: run it in a thread); returns the quotas
        closed or reopened."""
        with self._lock:
            watched = sorted(self._watched.items(), key=lambda item: item[1].counted_at)
        now = time.monotonic()
        self._tokens = min(self.burst_s, self._tokens + (now - self._filled) * self.share)
        self._filled = now
        changes = []
        for sandbox_id, w in watched:
            try:
                change = self._check(sandbox_id, w)
            except FileNotFoundError:
                continue  # destroyed meanwhile
            except OSError as exc:
                log.warning("cannot count the inodes of %s: %s", sandbox_id, exc)
                continue
            with self._lock:
                current = self._watched.get(sandbox_id) is w  # not restored meanwhile
            if change is not None and current:
                changes.append(change)
        return changes

    def _check(self, sandbox_id: str, w: _Watched) -> Change | None:
        if w.skip:
            w.skip -= 1
            return None
        fd = os.open(w.rw, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            high = UpperFs.highest_inode(fd, w.high)
            if w.closed is False and w.count + high - w.high < w.limit:
                return None
            if self._tokens <= 0:
                return None  # counted at a later look
            started = time.perf_counter()
            w.count, w.high = UpperFs.count_inodes(fd), max(high, w.high)
            w.counted_at = time.monotonic()
            took = time.perf_counter() - started
            self._tokens -= took
            self.counted_s += took
            over = w.count >= w.limit
            if over and w.closed is True:  # still over: count again later, and later
                w.backoff = min(2 * w.backoff + 1, MAX_SKIP)
                w.skip = w.backoff
            if over == w.closed:
                return None
            w.backoff = 0
            self.fs.set_limit(UpperFs.subvolume(fd), _CLOSED if over else w.disk_bytes)
            w.closed = over
            return Change(sandbox_id, w.count, w.limit, over)
        finally:
            os.close(fd)
