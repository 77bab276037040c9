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
from collections.abc import Awaitable, Callable

from dsec_kernel import bus
from dsec_kernel.apiserver.edges import Power
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    DestroyResponse,
    JobCloseRequest,
    JobInfo,
    JobRenewRequest,
    SandboxInfo,
)
from dsec_kernel.state.buckets import JOBS
from dsec_kernel.state.facade import ClusterState

__all__ = ["JobLookup", "Leases", "job_key"]

log = logging.getLogger(__name__)

#: ``job(tenant, name)``: a tenant's job, or None (:meth:`Leases.job`)
JobLookup = Callable[[str, str], JobInfo | None]


def job_key(tenant: str, name: str) -> str:
    return f"{tenant}.{name}"


class Leases:
    """The apiserver's part in jobs: its handlers and its periodic :meth:`check`."""

    def __init__(
        self,
        state: ClusterState,
        registry: Registry,
        power: Power,
        destroy_all: Callable[[list[SandboxInfo]], Awaitable[list[str]]],
    ) -> None:
        self.state = state
        self.registry = registry
        self.power = power
        self.destroy_all = destroy_all
        self.jobs = state.mirror(JOBS, JobInfo.model_validate_json)

    def job(self, tenant: str, name: str) -> JobInfo | None:
        return self.jobs.get(job_key(tenant, name))

    async def renew(self, r: JobRenewRequest, call: bus.Call) -> JobInfo:
        tenant = call.tenant
        key = job_key(tenant, r.name)
        for _ in range(10):
            now = time.time()
            hit = await self.state.get_job(key)
            info = JobInfo(
                name=r.name, tenant=tenant, priority=r.priority, lease_s=r.lease_s,
                created_at=hit[0].created_at if hit else now, renewed_at=now,
                expires_at=now + r.lease_s,
            )  # fmt: skip
            try:
                await self.state.cas_job(key, info, hit[1] if hit else None)
            except errors.Conflict:
                continue
            if hit is not None and hit[0].state == "lapsed":
                log.info("job %s of %s renewed after its lease lapsed: resuming", r.name, tenant)
                await self._set_power(tenant, r.name, "resume")
            return info
        raise errors.Conflict(f"job {r.name} keeps changing; try again")

    async def close(self, r: JobCloseRequest, call: bus.Call) -> DestroyResponse:
        tenant = call.tenant
        mine = self.registry.job_members(tenant, r.name)
        destroyed = await self.destroy_all(mine)
        await self.state.delete_job(job_key(tenant, r.name))
        return DestroyResponse(destroyed=destroyed)

    async def check(self) -> None:
        """Mark leases past their expiry lapsed, and pause their jobs' live sandboxes."""
        now = time.time()
        for key, (info, rev) in list(self.jobs.items.items()):
            if info.state == "active" and info.expires_at < now:
                try:
                    await self.state.cas_job(key, info.model_copy(update={"state": "lapsed"}), rev)
                except errors.Conflict:
                    continue  # renewed meanwhile, or another apiserver took it
                log.warning(
                    "job %s of %s: lease lapsed (%.1f s without a renewal); pausing its sandboxes",
                    info.name, info.tenant, now - info.renewed_at,
                )  # fmt: skip
                await self._set_power(info.tenant, info.name, "pause")
            elif info.state == "lapsed" and self.registry.job_members(
                info.tenant, info.name, ("ready",)
            ):
                await self._set_power(info.tenant, info.name, "pause")

    async def _set_power(self, tenant: str, name: str, op: str) -> None:
        # a resume goes to all of them: the edge resumes only those the lapse paused
        infos = self.registry.job_members(tenant, name, ("ready",) if op == "pause" else ())
        for part in await self.power(op, infos, "lease"):
            for f in part.failed:
                log.info("%s of %s (job %s) failed: %s", op, f.id, name, f.error.message)
