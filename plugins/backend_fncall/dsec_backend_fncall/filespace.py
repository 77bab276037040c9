"""What fncall sandboxes' files take on the node's disk, held to limits.

Only the supervisor writes there (``write_file``; calls see the files read-only, through an
overlay), so it can count exactly: per sandbox, bytes of file data and entries (files and
directories), against the sandbox's ``Limits.disk_mb`` and ``Limits.inodes`` (else the
backend's defaults); all sandboxes together against the node's ``total_mb``. A write past
any is refused before it touches the disk (``QuotaExceeded``). Use is counted from the
directories at start, then kept; a destroyed sandbox's is forgotten.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dsec_kernel import errors

__all__ = ["FileSpace"]


class FileSpace:
    """Use and limits of the sandboxes under ``root`` (``<root>/<id>/files``, with their
    limits in ``<root>/<id>/limits.json``)."""

    def __init__(self, root: Path, disk_mb: int, inodes: int, total_mb: int) -> None:
        self.root = root
        self.default_bytes = disk_mb << 20
        self.default_inodes = inodes
        self.total_bytes = total_mb << 20
        self._used: dict[str, list[int]] = {  # sandbox -> [bytes, entries]
            d.name: list(_walk(d / "files")) for d in root.iterdir() if d.is_dir()
        }
        self._total = sum(used[0] for used in self._used.values())

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
        if bytes_ > 0 and self._total + bytes_ > self.total_bytes:
            raise errors.QuotaExceeded(
                "this node's disk for fncall sandboxes' files is full; destroy sandboxes, or "
                "create this one elsewhere"
            )
        used[0] += bytes_
        used[1] += entries
        self._total += bytes_

    def forget(self, sandbox: str) -> None:
        """The sandbox's files are gone."""
        used = self._used.pop(sandbox, None)
        if used is not None:
            self._total -= used[0]

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


def _walk(root: Path) -> tuple[int, int]:
    """(bytes of file data, entries) below ``root`` (none if it is missing)."""
    size = count = 0
    for d, dirs, files in os.walk(root):
        count += len(dirs) + len(files)
        for name in files:
            try:
                size += os.lstat(os.path.join(d, name)).st_size
            except FileNotFoundError:
                pass
    return size, count
