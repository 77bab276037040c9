"""What fncall sandboxes' files take on the node's disk, held to limits.

Only the supervisor writes there (``write_file``; calls see the files read-only, through an
overlay), so it can count exactly: per sandbox, the bytes its entries take on disk (their
blocks, at least one each: :func:`cost`) and how many entries (files and directories)
against the sandbox's ``Limits.disk_mb`` and ``Limits.inodes`` (else the backend's
defaults); all sandboxes together against the node's ``total_mb`` and ``total_inodes``. A
write past any is refused before it touches the disk (``QuotaExceeded``). Use is counted from the
directories at start, then kept; a destroyed sandbox's is forgotten.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from dsec_kernel.contract import errors

__all__ = ["BLOCK", "MAX_DEPTH", "FileSpace", "cost"]

#: what the smallest entry is counted as
BLOCK = 4096
#: deepest path under a sandbox's /tmp that write_file makes
MAX_DEPTH = 64
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FileSpace:
    """Use and limits of the sandboxes under ``root`` (``<root>/<id>/files``, with their
    limits in ``<root>/<id>/limits.json``)."""

    def __init__(
        self, root: Path, disk_mb: int, inodes: int, total_mb: int, total_inodes: int
    ) -> None:
        self.root = root
        self.default_bytes = disk_mb << 20
        self.default_inodes = inodes
        self.total_bytes = total_mb << 20
        self.total_inodes = total_inodes
        self._used: dict[str, list[int]] = {  # sandbox -> [bytes, entries]
            d.name: list(_walk(d / "files")) for d in root.iterdir() if d.is_dir()
        }
        self._total = [sum(used[i] for used in self._used.values()) for i in (0, 1)]

    def charge(self, sandbox: str, bytes_: int, entries: int) -> None:
        """Count ``bytes_`` more (fewer, if negative) and ``entries`` more for ``sandbox``;
        QuotaExceeded, counting nothing, if that passes its limits or the node's."""
        used = self._usage(sandbox)
        limit_bytes, limit_inodes = self._limits(sandbox)
        if bytes_ > 0 and used[0] + bytes_ > limit_bytes:
            raise errors.QuotaExceeded(
                f"sandbox {sandbox}: its files take {used[0]} bytes; {bytes_} more would pass "
                f"its disk limit of {limit_bytes} (Limits.disk_mb)"
            )
        if entries > 0 and used[1] + entries > limit_inodes:
            raise errors.QuotaExceeded(
                f"sandbox {sandbox}: it holds {used[1]} files and directories, the most it "
                f"may is {limit_inodes} (Limits.inodes)"
            )
        if (bytes_ > 0 and self._total[0] + bytes_ > self.total_bytes) or (
            entries > 0 and self._total[1] + entries > self.total_inodes
        ):
            raise errors.QuotaExceeded(
                "this node's disk for fncall sandboxes' files is full; destroy sandboxes, or "
                "create this one elsewhere"
            )
        for i, n in enumerate((bytes_, entries)):
            used[i] += n
            self._total[i] += n

    def forget(self, sandbox: str) -> None:
        """The sandbox's files are gone."""
        used = self._used.pop(sandbox, None)
        if used is not None:
            self._total = [t - u for t, u in zip(self._total, used, strict=True)]

    def _usage(self, sandbox: str) -> list[int]:
        used = self._used.get(sandbox)
        if used is None:
            used = self._used[sandbox] = list(_walk(self.root / sandbox / "files"))
        return used

    def _limits(self, sandbox: str) -> tuple[int, int]:
        try:
            limits = json.loads((self.root / sandbox / "limits.json").read_text())
        except (OSError, ValueError):
            limits = {}
        disk_mb, inodes = limits.get("disk_mb"), limits.get("inodes")
        return (
            disk_mb << 20 if disk_mb else self.default_bytes,
            inodes or self.default_inodes,
        )


def cost(st: os.stat_result) -> int:
    """What an entry takes on disk, as counted: its blocks, at least one (a directory or an
    empty file takes an inode and a block's worth of metadata too)."""
    return max(st.st_blocks * 512, st.st_size if stat.S_ISREG(st.st_mode) else 0, BLOCK)


def _walk(root: Path) -> tuple[int, int]:
    """(bytes as :func:`cost` counts them, entries) below ``root`` (none if it is missing);
    iterative, through directory descriptors (a tree may be deeper than any path can name),
    never following a symlink."""
    size = count = 0
    try:
        top = os.open(root, _DIR)
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    stack = [top]
    try:
        while stack:
            fd = stack.pop()
            try:
                with os.scandir(fd) as it:
                    entries = list(it)
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    count += 1
                    size += cost(st)
                    if stat.S_ISDIR(st.st_mode):
                        try:
                            stack.append(os.open(entry.name, _DIR, dir_fd=fd))
                        except (FileNotFoundError, NotADirectoryError):
                            pass
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return size, count
