"""Trainer leases, served by the apiserver: ``dsec.api.v1.job.renew`` and ``job.close``.

A job's record lives in KV (``dsec-jobs``). Every apiserver checks the leases it mirrors: the
first to see one past ``expires_at`` marks it ``lapsed`` (compare-and-set) and pauses the
job's live sandboxes with reason ``lease``; while it stays lapsed, sandboxes that could not
be paused yet (a command was running) are tried again at every check. A renewal of a lapsed
job marks it ``active`` and resumes what the lapse paused.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    DestroyResponse,
    JobCloseRequest,
    JobInfo,
    JobRenewRequest,
    SandboxInfo,
)
from dsec_kernel.state import JOBS, Mirror

if TYPE_CHECKING:
    from dsec_kernel.apiserver import ApiServer

__all__ = ["Leases", "job_key"]

log = logging.getLogger(__name__)


def job_key(tenant: str, name: str) -> str:
    return f"{tenant}.{name}"


class Leases:
    """The apiserver's part in jobs: its handlers and its periodic :meth:`check`."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.jobs: Mirror[JobInfo] | None = None

    async def start(self) -> Mirror[JobInfo]:
        assert self.api.state is not None
        self.jobs = Mirror(self.api.state.js, JOBS, JobInfo.model_validate_json)
        await self.jobs.start()
        return self.jobs

    def job(self, tenant: str, name: str) -> JobInfo | None:
        assert self.jobs is not None
        return self.jobs.get(job_key(tenant, name))

    async def renew(self, req: bus.Request) -> JobInfo:
        tenant = await self.api._auth(req)
        r = JobRenewRequest.model_validate_json(req.data)
        state = self.api.state
        assert state is not None
        key = job_key(tenant, r.name)
        for _ in range(10):
            now = time.time()
            hit = await state.get_job(key)
            info = JobInfo(
                name=r.name, tenant=tenant, priority=r.priority, lease_s=r.lease_s,
                created_at=hit[0].created_at if hit else now, renewed_at=now,
                expires_at=now + r.lease_s,
            )  # fmt: skip
            try:
                await state.cas_job(key, info, hit[1] if hit else None)
            except errors.Conflict:
                continue
            if hit is not None and hit[0].state == "lapsed":
                log.info("job %s of %s renewed after its lease lapsed: resuming", r.name, tenant)
                await self._set_power(tenant, r.name, "resume")
            return info
        raise errors.Conflict(f"job {r.name} keeps changing; try again")

    async def close(self, req: bus.Request) -> DestroyResponse:
        tenant = await self.api._auth(req)
        r = JobCloseRequest.model_validate_json(req.data)
        assert self.api.state is not None
        mine = self._sandboxes(tenant, r.name)
        destroyed = await self.api.destroy_all(mine)
        await self.api.state.jobs.delete(job_key(tenant, r.name))
        return DestroyResponse(destroyed=destroyed)

    def _sandboxes(self, tenant: str, name: str, states: tuple[str, ...] = ()) -> list[SandboxInfo]:
        items = self.api.sandboxes.items
        hits = (items.get(sid) for sid in list(self.api.job_members.get((tenant, name), ())))
        return [h[0] for h in hits if h is not None and (not states or h[0].state in states)]

    async def check(self) -> None:
        """Mark leases past their expiry lapsed, and pause their jobs' live sandboxes."""
        assert self.jobs is not None and self.api.state is not None
        now = time.time()
        for key, (info, rev) in list(self.jobs.items.items()):
            if info.state == "active" and info.expires_at < now:
                try:
                    await self.api.state.cas_job(
                        key, info.model_copy(update={"state": "lapsed"}), rev
                    )
                except errors.Conflict:
                    continue  # renewed meanwhile, or another apiserver took it
                log.warning(
                    "job %s of %s: lease lapsed (%.1f s without a renewal); pausing its sandboxes",
                    info.name, info.tenant, now - info.renewed_at,
                )  # fmt: skip
                await self._set_power(info.tenant, info.name, "pause")
            elif info.state == "lapsed" and self._sandboxes(info.tenant, info.name, ("ready",)):
                await self._set_power(info.tenant, info.name, "pause")

    async def _set_power(self, tenant: str, name: str, op: str) -> None:
        # a resume goes to all of them: the edge resumes only those the lapse paused
        infos = self._sandboxes(tenant, name, ("ready",) if op == "pause" else ())
        for part in await self.api.power(op, infos, "lease"):
            for f in part.failed:
                log.info("%s of %s (job %s) failed: %s", op, f.id, name, f.error.message)
