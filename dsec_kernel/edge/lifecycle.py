"""Making and destroying sandboxes, and reporting those that end by themselves."""

from __future__ import annotations

import asyncio
import logging
import time

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, SandboxRef
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import (
    DestroyRequest,
    DestroyResponse,
    EdgeCreateRequest,
    EdgeCreateResponse,
    EdgeSandbox,
    Error,
    Failure,
    SandboxInfo,
)
from dsec_kernel.edge.backends import named
from dsec_kernel.edge.node import RecentLayers
from dsec_kernel.edge.table import SandboxRecord, SandboxTable
from dsec_kernel.state.facade import ClusterState
from dsec_kernel.trajectory import Replays

__all__ = ["Lifecycle"]

log = logging.getLogger(__name__)


class Lifecycle:
    """Creates sandboxes in the node's backends (``concurrency`` at once per backend),
    destroys them and reports lost those that ended by themselves, keeping the table, the
    replays and the plugins told."""

    def __init__(
        self,
        node: str,
        backends: dict[str, Backend],
        table: SandboxTable,
        state: ClusterState,
        hooks: Hooks,
        replays: Replays,
        layers: RecentLayers,
        concurrency: int,
    ) -> None:
        self.node = node
        self.backends = backends
        self.table = table
        self.state = state
        self.hooks = hooks
        self.replays = replays
        self.layers = layers
        self._slots = {n: asyncio.Semaphore(concurrency) for n in backends}
        # sandboxes not in the table yet: ids whose backend create is under way, and of
        # those the ids destroyed meanwhile
        self._creating: set[str] = set()
        self._doomed: set[str] = set()

    async def create(self, r: EdgeCreateRequest, call: bus.Call) -> EdgeCreateResponse:
        results = await asyncio.gather(*(self._create_one(sb) for sb in r.sandboxes))
        out = EdgeCreateResponse(completed_at=time.time())
        for sb, res in zip(r.sandboxes, results, strict=True):
            if isinstance(res, SandboxInfo):
                out.created.append(res)
            else:
                out.failed.append(Failure(id=sb.id, error=Error.of(res)))
        return out

    async def _create_one(self, sb: EdgeSandbox) -> SandboxInfo | errors.DsecError:
        known = self.table.get(sb.id)
        if known is not None:
            return known.info
        self._creating.add(sb.id)
        try:
            backend = named(self.backends, sb.spec.backend, self.node)
            async with self._slots[sb.spec.backend]:
                status = await backend.create(sb)
        except errors.DsecError as exc:
            return exc
        except Exception:
            log.exception("creating %s failed", sb.id)
            return errors.Internal(f"creating {sb.id} on {self.node} failed")
        finally:
            self._creating.discard(sb.id)
            doomed = sb.id in self._doomed
            self._doomed.discard(sb.id)
        if doomed:  # its creator gave up on it (a timeout) and destroyed it meanwhile
            await backend.destroy(SandboxRef(sandbox_id=sb.id))
            return errors.Conflict(f"sandbox {sb.id} was destroyed while it was being made")
        info = SandboxInfo(
            id=sb.id,
            tenant=sb.tenant,
            backend=sb.spec.backend,
            node=self.node,
            created_at=sb.created_at,
            expires_at=sb.expires_at,
            labels=sb.spec.labels,
            job=sb.spec.job,
            idle_ttl_s=sb.spec.idle_ttl_s,
            spec=sb.spec,
        )
        self.table.add(SandboxRecord(info, backend, made_at=time.monotonic()))
        self.replays.fresh(sb.id)
        self.layers.use(status.layers)
        await self.hooks.sandbox_created(info)
        return info

    async def destroy(self, r: DestroyRequest, call: bus.Call) -> DestroyResponse:
        out = DestroyResponse()
        found = [(i, self.table.get(i)) for i in r.ids]
        await asyncio.gather(
            *(self.destroy_one(i, rec.backend, rec.info, "requested") for i, rec in found if rec)
        )
        # ids this edge does not know may still hold something in a backend (one lost while
        # its report was on its way, say): every backend's destroy is idempotent
        unknown = [i for i, rec in found if rec is None]
        self._doomed.update(i for i in unknown if i in self._creating)  # destroyed once made
        await asyncio.gather(
            *(b.destroy(SandboxRef(sandbox_id=i)) for i in unknown for b in self.backends.values())
        )
        for i, rec in found:
            (out.destroyed if rec else out.not_found).append(i)
        return out

    async def destroy_one(
        self, sandbox_id: str, backend: Backend, info: SandboxInfo | None, reason: str
    ) -> None:
        """Destroy the sandbox in ``backend`` and forget it (``info``: its record, if it
        has one, for the plugins)."""
        await backend.destroy(SandboxRef(sandbox_id=sandbox_id))
        self.table.remove(sandbox_id)
        self.replays.forget(sandbox_id)
        if info is not None:
            await self.hooks.sandbox_destroyed(info, reason)

    async def report_lost(self, sandbox_id: str, reason: str) -> None:
        """A backend saw the sandbox end by itself: record it lost at once, then destroy it,
        so that what it held (files, cgroups, layer holds) is released now rather than when
        its tenant destroys it."""
        rec = self.table.remove(sandbox_id)
        if rec is None:
            return
        log.warning("sandbox %s is lost: %s", sandbox_id, reason)
        self.replays.forget(sandbox_id)
        try:
            await self.state.set_sandbox_state(sandbox_id, "lost")
        except errors.DsecError as exc:  # reconciliation reports it later
            log.warning("could not record %s lost: %s", sandbox_id, exc)
        try:
            await rec.backend.destroy(SandboxRef(sandbox_id=sandbox_id))
        except Exception:
            log.exception("destroying lost sandbox %s failed", sandbox_id)
        await self.hooks.guard_event(sandbox_id, "sandbox_lost", {"reason": reason})
        await self.hooks.sandbox_destroyed(rec.info, "lost")
