"""Host uid ranges for sandboxes' user namespaces, one range per sandbox, node-wide.

Root in a sandbox is uid ``base`` of the host, its uid 1 is ``base + 1``, and so on for
65,536 uids: no two live sandboxes of a node (of any edge on it) share a uid, so none can
signal, trace or read another's processes or files through a shared identity, and none of
them is anyone on the host. A range is claimed by making ``<claims>/<slot>`` a symlink to the
sandbox's directory (atomic: it exists or not, and says whose it is), so edges on one node
never collide, and a claim whose sandbox directory is gone (its edge and state were removed
without cleaning up) can be recognised and collected by any of them.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from dsec_kernel.contract import errors

__all__ = ["UidRanges"]

#: first host uid of the first range: far above accounts and fncall's uids, below 2^31
FIRST_UID = 1 << 28
RANGE = 1 << 16


class UidRanges:
    """Claims and releases ranges under ``claims`` (shared by every edge of the node)."""

    def __init__(self, claims: Path = Path("/run/dsec/userns")) -> None:
        self.claims = claims
        self.slots = ((1 << 31) - FIRST_UID) // RANGE
        claims.mkdir(parents=True, exist_ok=True, mode=0o700)

    def base(self, slot: int) -> int:
        return FIRST_UID + slot * RANGE

    def _slot(self, base: int) -> int:
        slot, rest = divmod(base - FIRST_UID, RANGE)
        if rest or not 0 <= slot < self.slots:
            raise ValueError(f"{base} is not the start of a sandbox uid range")
        return slot

    def claim(self, sandbox_dir: Path) -> int:
        """A free range for the sandbox whose directory is ``sandbox_dir`` (made soon after);
        returns its first host uid."""
        start = int(hashlib.sha256(str(sandbox_dir).encode()).hexdigest(), 16) % self.slots
        for i in range(self.slots):
            slot = (start + i) % self.slots
            try:
                os.symlink(sandbox_dir, self.claims / str(slot))
            except FileExistsError:
                continue
            return self.base(slot)
        raise errors.CapacityExceeded("no free uid range for another sandbox on this node")

    def release(self, base: int) -> None:
        """Give the range back. Idempotent."""
        try:
            os.unlink(self.claims / str(self._slot(base)))
        except FileNotFoundError:
            pass

    def adopt(self, root: Path, keep: dict[Path, int]) -> None:
        """After a restart of the backend whose sandboxes' directories are below ``root``:
        its claims are exactly ``keep`` (sandbox directory -> base); the others of its
        claims go, missing ones are made again. Then claims anyone left whose sandbox
        directory is gone are collected."""
        wanted = {self._slot(b): str(d) for d, b in keep.items()}
        for entry, target in self._entries():
            if Path(target).parent == root and wanted.get(int(entry.name)) != target:
                entry.unlink(missing_ok=True)
        for slot, target in wanted.items():
            try:
                os.symlink(target, self.claims / str(slot))
            except FileExistsError:
                pass
        self.collect()

    def collect(self, grace_s: float = 60.0) -> None:
        """Remove claims older than ``grace_s`` whose sandbox directory does not exist (a
        create claims before it makes the directory)."""
        now = time.time()
        for entry, target in self._entries():
            try:
                if now - entry.lstat().st_mtime > grace_s and not os.path.isdir(target):
                    entry.unlink(missing_ok=True)
            except FileNotFoundError:
                continue

    def _entries(self) -> list[tuple[Path, str]]:
        out = []
        for entry in self.claims.iterdir():
            try:
                out.append((entry, os.readlink(entry)))
            except OSError:  # not a claim of this kind (a file of an older DSec): stale
                entry.unlink(missing_ok=True)
        return out
