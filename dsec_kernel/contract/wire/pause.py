"""Pause and resume: processes frozen and their memory reclaimed, then thawed intact."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract.wire.base import Message, SandboxId, TypedError
from dsec_kernel.contract.wire.sandbox import MAX_BATCH, Failure

__all__ = ["PAUSE_REASONS", "PauseReport", "PauseRequest", "PauseResponse", "ResumeRequest"]

#: Why a sandbox is paused. ``requested``: by its owner; ``lease``: its job's trainer lease
#: lapsed; ``idle``: no command for its ``idle_ttl_s``; ``priority``: to admit a
#: higher-priority job. Work sent to an ``idle`` sandbox resumes it; the others wait for
#: ``resume()`` (or the lease's renewal, or the pressure to pass).
PAUSE_REASONS = ("requested", "lease", "idle", "priority")
PauseReason = Literal["requested", "lease", "idle", "priority"]


class PauseReport(BaseModel):
    """What one pause or resume did (a backend's answer, passed on to the caller), or, with
    ``error`` set and the rest empty, why it could not be done (a batch's entry for that
    sandbox; ``Sandbox.pause`` raises it)."""

    model_config = ConfigDict(extra="ignore")

    sandbox_id: SandboxId
    state: str = Field("", description="paused or ready")
    seconds: float = Field(0.0, description="time the backend took")
    memory_before_bytes: int = Field(0, description="the sandbox's memory charge before")
    memory_after_bytes: int = Field(0, description="its memory charge after (RAM only)")
    swapped_bytes: int = Field(0, description="of it, moved to compressed swap")
    error: TypedError | None = Field(None, description="why it could not be done")


class PauseRequest(Message):
    """Pause sandboxes: freeze every process, then reclaim their memory. Idempotent."""

    type: Literal["io.dsec.sandbox.v1.pause_request"] = "io.dsec.sandbox.v1.pause_request"
    ids: list[SandboxId] = Field(min_length=1, max_length=MAX_BATCH)
    reason: PauseReason = "requested"


class ResumeRequest(Message):
    """Resume paused sandboxes with every process and file as it was. Idempotent."""

    type: Literal["io.dsec.sandbox.v1.resume_request"] = "io.dsec.sandbox.v1.resume_request"
    ids: list[SandboxId] = Field(min_length=1, max_length=MAX_BATCH)
    reason: PauseReason | None = Field(
        None, description="resume only sandboxes paused for this reason (None: any)"
    )


class PauseResponse(Message):
    type: Literal["io.dsec.sandbox.v1.pause_response"] = "io.dsec.sandbox.v1.pause_response"
    done: list[PauseReport] = Field(default_factory=list)
    failed: list[Failure] = Field(default_factory=list)
