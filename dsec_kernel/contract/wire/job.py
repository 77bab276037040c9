"""Jobs: a trainer's lease on a group of sandboxes.

A trainer opens a job and renews its lease (a heartbeat over NATS) while it runs. When the
lease lapses — the trainer was preempted or died — the job's sandboxes are paused, not
destroyed; a renewal resumes them. Closing the job destroys them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dsec_kernel.contract.wire.base import Message, Name

__all__ = ["MAX_LEASE_S", "JobCloseRequest", "JobInfo", "JobRenewRequest"]

#: Longest lease a job may ask for (one hour without a renewal).
MAX_LEASE_S = 3600.0


class JobInfo(Message):
    """A job's record (KV bucket ``dsec-jobs``, key ``<tenant>.<name>``).

    ``state`` is ``active`` while renewals come, ``lapsed`` after ``expires_at`` passed
    without one (its sandboxes are then paused with reason ``lease``).
    """

    type: Literal["io.dsec.job.v1.info"] = "io.dsec.job.v1.info"
    name: Name
    tenant: Name
    priority: int = Field(0, ge=0, le=100, description="higher wins under pressure")
    lease_s: float = Field(gt=0, le=MAX_LEASE_S)
    state: str = "active"
    created_at: float
    renewed_at: float
    expires_at: float


class JobRenewRequest(Message):
    """Open a job, or renew its lease (resuming its sandboxes if the lease had lapsed)."""

    type: Literal["io.dsec.job.v1.renew_request"] = "io.dsec.job.v1.renew_request"
    name: Name
    priority: int = Field(0, ge=0, le=100)
    lease_s: float = Field(30.0, ge=0.5, le=MAX_LEASE_S)


class JobCloseRequest(Message):
    """End a job: destroy its sandboxes and forget its lease. Idempotent."""

    type: Literal["io.dsec.job.v1.close_request"] = "io.dsec.job.v1.close_request"
    name: Name
