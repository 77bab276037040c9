"""The sandboxes on an edge's node: one record per sandbox, in one table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend
from dsec_kernel.contract.wire import SandboxInfo

__all__ = ["SandboxRecord", "SandboxTable"]


@dataclass(eq=False)
class SandboxRecord:
    """What the edge holds of one sandbox. A record taken out of the table (the sandbox
    destroyed or lost) may still be held by work that began before: writing it is harmless."""

    info: SandboxInfo  # its cluster record, as this edge last wrote or read it
    backend: Backend  # the backend it lives in
    made_at: float | None = None  # when this edge made it (monotonic); None: adopted
    paused: str | None = None  # why it is paused (a PAUSE_REASONS value); None: it is not
    reclaimed: int = 0  # bytes of memory its pause gave back
    busy: int = 0  # commands running in it
    used: float = field(default_factory=time.monotonic)  # when it last worked (monotonic)


class SandboxTable:
    """The records of the sandboxes on ``node``, by sandbox id; ``len``, ``in`` and
    iteration (over ids) as a dict's."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._records: dict[str, SandboxRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self._records.get(sandbox_id)

    def require(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox's record; NotFound if it is not on this node."""
        rec = self._records.get(sandbox_id)
        if rec is None:
            raise errors.NotFound(f"sandbox {sandbox_id} is not on node {self.node}")
        return rec

    def add(self, rec: SandboxRecord) -> None:
        self._records[rec.info.id] = rec

    def remove(self, sandbox_id: str) -> SandboxRecord | None:
        return self._records.pop(sandbox_id, None)

    def records(self) -> list[SandboxRecord]:
        """Every record, as of now (a list: the table may change while it is gone through)."""
        return list(self._records.values())
