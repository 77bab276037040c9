"""Host uid ranges for sandboxes' user namespaces, one range per sandbox, node-wide.

Root in a sandbox is uid ``base`` of the host, its uid 1 is ``base + 1``, and so on for
``size`` uids: no two live sandboxes of a node (of any edge on it) share a uid, so none can
signal, trace or read another's processes or files through a shared identity, and none of
them is anyone on the host. A range is claimed by creating ``<claims>/<slot>`` exclusively
(content: the claiming backend's tag and the sandbox), so edges on one node never collide.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dsec_kernel import errors

__all__ = ["UidRanges"]

#: first host uid of the first range: far above accounts and fncall's uids, below 2^31
FIRST_UID = 1 << 28
RANGE = 1 << 16


class UidRanges:
    """Claims and releases ranges; ``owner`` tags this backend's claims."""

    def __init__(self, owner: str, claims: Path = Path("/run/dsec/userns")) -> None:
        self.owner = owner
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

    def claim(self, sandbox_id: str) -> int:
        """A free range for ``sandbox_id``; returns its first host uid."""
        start = int(hashlib.sha256(sandbox_id.encode()).hexdigest(), 16) % self.slots
        for i in range(self.slots):
            slot = (start + i) % self.slots
            try:
                fd = os.open(self.claims / str(slot), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{self.owner} {sandbox_id}")
            return self.base(slot)
        raise errors.CapacityExceeded("no free uid range for another sandbox on this node")

    def release(self, base: int) -> None:
        """Give the range back. Idempotent."""
        try:
            os.unlink(self.claims / str(self._slot(base)))
        except FileNotFoundError:
            pass

    def adopt(self, keep: dict[str, int]) -> None:
        """After a restart: this backend's claims are exactly ``keep`` (sandbox id -> base);
        claims of sandboxes that are gone are released, missing ones made again."""
        wanted = {self._slot(b): sid for sid, b in keep.items()}
        for entry in self.claims.iterdir():
            try:
                owner, sid = entry.read_text().split(" ", 1)
            except (OSError, ValueError):
                continue
            if owner == self.owner and wanted.get(int(entry.name)) != sid:
                entry.unlink(missing_ok=True)
        for slot, sid in wanted.items():
            path = self.claims / str(slot)
            if not path.exists():
                path.write_text(f"{self.owner} {sid}")
