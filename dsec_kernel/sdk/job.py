"""A job: a trainer's lease on its sandboxes (see :meth:`AsyncClient.job`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    DestroyResponse,
    JobCloseRequest,
    JobInfo,
    JobRenewRequest,
    Message,
)
from dsec_kernel.sdk.results import NotCreated
from dsec_kernel.sdk.sandbox import Sandbox

__all__ = ["Job", "JobClient"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class JobClient(Protocol):
    """What a job asks of the client it came from: requests, and making and listing the
    tenant's sandboxes."""

    async def _call(
        self, op: str, msg: Message, reply: type[M], timeout: float | None = None
    ) -> M: ...

    async def create(self, *args: Any, **kwargs: Any) -> list[Sandbox | NotCreated]: ...

    async def list(self, labels: dict[str, str] | None = None) -> list[Sandbox]: ...


class Job:
    """``async with client.job(name, priority=, lease_s=) as job:`` opens the job and renews
    its lease in the background every ``lease_s / 3``; leaving the block destroys the job's
    sandboxes and ends it.

    If renewals stop for ``lease_s`` (the trainer was preempted; :meth:`stop_renewing` acts
    it out) the platform pauses the job's sandboxes — frozen, memory reclaimed, nothing lost
    — and :meth:`renew` resumes them.
    """

    def __init__(self, client: JobClient, request: JobRenewRequest) -> None:
        self._client = client
        self._request = request
        self.name = request.name
        self.info: JobInfo | None = None
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Job:
        await self.renew()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(self, count: int = 1, **kwargs: Any) -> list[Sandbox | NotCreated]:
        """:meth:`AsyncClient.create` for this job: the sandboxes share its lease."""
        return await self._client.create(count, job=self.name, **kwargs)

    async def sandboxes(self) -> list[Sandbox]:
        """The job's sandboxes, live or paused."""
        return [sb for sb in await self._client.list() if sb.info.job == self.name]

    async def renew(self) -> JobInfo:
        """Renew the lease now (resuming the job's sandboxes if it had lapsed), and keep
        renewing it in the background."""
        self.info = await self._client._call("job.renew", self._request, JobInfo)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_forever())
        return self.info

    def stop_renewing(self) -> None:
        """Stop the background renewals, as a preempted trainer would."""
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None

    async def close(self) -> list[str]:
        """Destroy the job's sandboxes and end the lease; returns the ids destroyed."""
        self.stop_renewing()
        req = JobCloseRequest(name=self.name)
        resp = await self._client._call("job.close", req, DestroyResponse)
        return resp.destroyed

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._request.lease_s / 3)
            try:
                self.info = await self._client._call("job.renew", self._request, JobInfo)
            except errors.DsecError as exc:  # the next attempt may get through
                log.warning("renewing job %s failed: %s", self.name, exc)
