"""Making what exists on the node and what the cluster state says agree."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend
from dsec_kernel.contract.wire import SandboxInfo
from dsec_kernel.edge.table import SandboxRecord, SandboxTable
from dsec_kernel.state.buckets import LIVE
from dsec_kernel.state.facade import ClusterState

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)

#: a sandbox this edge made so lately may have no record yet (its create's answer is on its way)
YOUNG_S = 30.0
#: every this many rounds, the records of every sandbox here are read, not only the odd ones
FULL_EVERY = 10

Destroy = Callable[[str, Backend, SandboxInfo | None, str], Awaitable[None]]


class Reconciler:
    """Adopts sandboxes the cluster still knows, destroys (with ``destroy``, see
    :meth:`~dsec_kernel.edge.lifecycle.Lifecycle.destroy_one`) those it does not or that
    were reported lost, and reports lost those that are gone."""

    def __init__(
        self,
        node: str,
        backends: dict[str, Backend],
        table: SandboxTable,
        state: ClusterState,
        destroy: Destroy,
    ) -> None:
        self.node = node
        self.backends = backends
        self.table = table
        self.state = state
        self.destroy = destroy
        self.rounds = 0

    async def run(self, full: bool = False) -> None:
        """One round. ``full`` (at start) reads every record to find this node's. Later
        rounds read records by key: those of sandboxes the node has but does not know or
        knows but no longer has, and every tenth round those of all it has (a record
        reported lost or deleted elsewhere) — so a round's cost does not grow with the
        cluster."""
        had = set(self.table)
        present: dict[str, Backend] = {}
        for backend in self.backends.values():
            for sid in await backend.list_sandboxes():
                present[sid] = backend
        self.rounds += 1
        checked: set[str] | None = None  # None: every record was read
        if full:
            records = await self.state.scan_sandboxes(self.node)
        else:
            check = [*present, *self.table]
            if self.rounds % FULL_EVERY:
                check = [i for i in check if (i in present) != (i in self.table)]
            checked = set(check)
            known = await self.state.get_sandboxes(check)
            records = {k: v for k, v in known.items() if v[0].node == self.node}
        young = time.monotonic() - YOUNG_S
        for sid, backend in present.items():
            if checked is not None and sid not in checked:
                continue  # known and present: its record is read every tenth round
            rec = records.get(sid)
            if rec is not None and rec[0].state in LIVE:
                if sid not in self.table:
                    adopted = SandboxRecord(rec[0], backend)
                    if rec[0].state == "paused":
                        adopted.paused = rec[0].paused_reason or "requested"
                    self.table.add(adopted)
                continue
            local = self.table.get(sid)
            made = local.made_at if local is not None else None
            if rec is None and made is not None and made > young:
                continue
            if sid in had and local is None:
                continue  # destroyed while this round read the records
            info = rec[0] if rec else local.info if local else None
            log.warning("reconcile: destroying %s (%s)", sid, "lost" if rec else "unknown")
            await self.destroy(sid, backend, info, "reconcile")
        for sid, (info, rev) in records.items():
            if sid not in present and info.state in LIVE:
                self.table.remove(sid)
                with suppress(errors.Conflict):
                    await self.state.cas_sandbox(info.model_copy(update={"state": "lost"}), rev)
                log.warning("reconcile: %s is gone from this node; reported lost", sid)
