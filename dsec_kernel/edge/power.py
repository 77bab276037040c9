"""Pausing and resuming sandboxes: on request, for idleness, and before work."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import SandboxRef
from dsec_kernel.contract.wire import (
    Error,
    Failure,
    PauseReport,
    PauseRequest,
    PauseResponse,
    ResumeRequest,
)
from dsec_kernel.edge.table import SandboxRecord, SandboxTable
from dsec_kernel.state.facade import ClusterState

__all__ = ["Power"]

log = logging.getLogger(__name__)


class Power:
    """Pauses and resumes the table's sandboxes, recording each change in the cluster state.

    A sandbox is never paused while a command runs in it (:attr:`SandboxRecord.busy`); once
    its record says paused, new work waits for the resume or is refused (:meth:`awake`).
    """

    def __init__(self, table: SandboxTable, state: ClusterState) -> None:
        self.table = table
        self.state = state

    async def pause(self, r: PauseRequest, call: bus.Call) -> PauseResponse:
        results = await asyncio.gather(
            *(self.pause_one(i, r.reason) for i in r.ids), return_exceptions=True
        )
        return _power_response(r.ids, results)

    async def resume(self, r: ResumeRequest, call: bus.Call) -> PauseResponse:
        results = await asyncio.gather(
            *(self.resume_one(i, r.reason) for i in r.ids), return_exceptions=True
        )
        return _power_response(r.ids, results)

    async def awake(self, rec: SandboxRecord) -> None:
        """Ready ``rec``'s sandbox for work: one paused for being idle is resumed first; one
        paused for another reason raises SandboxPaused."""
        why = rec.paused
        if why == "idle":
            await self.resume_one(rec.info.id, None)
        elif why is not None:
            what = {"lease": "renew its job's lease", "priority": "wait, or resume() it"}
            raise errors.SandboxPaused(
                f"sandbox {rec.info.id} is paused ({why}): {what.get(why, 'resume() it')} first"
            )
        rec.used = time.monotonic()

    async def pause_one(self, sandbox_id: str, reason: str) -> PauseReport:
        rec = self.table.require(sandbox_id)
        if not rec.backend.capabilities.pause:
            raise errors.Unsupported(f"the {rec.info.backend} backend cannot pause")
        if rec.paused is not None:
            if rec.paused == "idle":  # a stronger reason replaces idleness
                rec.paused = reason
                await self._record(rec, "paused", reason)
            return PauseReport(sandbox_id=sandbox_id, state="paused")
        if rec.busy:
            raise errors.Conflict(
                f"a command is running in {sandbox_id}; pause it when the command ends"
            )
        rec.paused = reason  # from here on, new work waits or is refused
        try:
            report = await rec.backend.pause(SandboxRef(sandbox_id=sandbox_id))
        except BaseException:
            rec.paused = None
            raise
        rec.reclaimed = max(0, report.memory_before_bytes - report.memory_after_bytes)
        await self._record(rec, "paused", reason)
        return report

    async def resume_one(self, sandbox_id: str, reason: str | None) -> PauseReport:
        """Resume the sandbox (only if paused for ``reason``, when one is given)."""
        rec = self.table.require(sandbox_id)
        why = rec.paused
        if why is None:
            return PauseReport(sandbox_id=sandbox_id, state="ready")
        if reason is not None and why != reason:
            return PauseReport(sandbox_id=sandbox_id, state="paused")
        report = await rec.backend.resume(SandboxRef(sandbox_id=sandbox_id))
        rec.paused = None
        rec.reclaimed = 0
        rec.used = time.monotonic()
        await self._record(rec, "ready", None)
        return report

    async def pause_idle(self) -> None:
        """Pause sandboxes that ran no command for their ``idle_ttl_s``."""
        now = time.monotonic()
        for rec in self.table.records():
            ttl = rec.info.idle_ttl_s
            if ttl is None or rec.paused is not None or rec.busy:
                continue
            if now - rec.used >= ttl and rec.backend.capabilities.pause:
                try:
                    await self.pause_one(rec.info.id, "idle")  # (if it is still there)
                    log.info("paused %s: idle for %.0f s", rec.info.id, now - rec.used)
                except errors.DsecError as exc:
                    log.warning("could not pause idle %s: %s", rec.info.id, exc)

    async def _record(self, rec: SandboxRecord, state: str, reason: str | None) -> None:
        info = await self.state.set_sandbox_state(rec.info.id, state, reason)
        if info is not None:
            rec.info = info


def _power_response(ids: list[str], results: list[Any]) -> PauseResponse:
    out = PauseResponse()
    for sid, res in zip(ids, results, strict=True):
        if isinstance(res, PauseReport):
            out.done.append(res)
        elif isinstance(res, errors.DsecError):
            out.failed.append(Failure(id=sid, error=Error.of(res)))
        else:
            log.error("pause/resume of %s failed", sid, exc_info=res)
            err = errors.Internal(f"pause/resume of {sid} failed; the edge's log says why")
            out.failed.append(Failure(id=sid, error=Error.of(err)))
    return out
