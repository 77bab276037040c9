"""What batch calls answer: one entry per sandbox, each carrying its own error.

The SDK's batch calls answer one entry per sandbox, in the order asked:

=====================  ====================================================
call                   entry
=====================  ====================================================
``exec_many``          :class:`~dsec_kernel.contract.wire.ExecResult`
``pause``, ``resume``  :class:`~dsec_kernel.contract.wire.PauseReport`
``destroy``            :class:`DestroyReport`
``create(count=N)``    :class:`~dsec_kernel.sdk.Sandbox`, or :class:`NotCreated`
=====================  ====================================================

Every entry has ``error`` (:class:`BatchEntry`): None where the operation was done, else the
typed error (a :class:`~dsec_kernel.DsecError`) that sandbox met — so a sandbox lost,
destroyed or paused meanwhile costs the caller none of the others' results. The call itself
raises only when the request as a whole failed: bad arguments, a credential the platform does
not know, the platform not answering; and ``create``, when it could make none. (Calls on one
sandbox, such as ``Sandbox.exec``, raise their error.) :func:`check` turns a batch's
entries back into all-or-an-exception.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import TypedError

__all__ = ["BatchEntry", "DestroyReport", "NotCreated", "check", "check_one"]


class BatchEntry(Protocol):
    """One sandbox's entry in a batch call's answer."""

    @property
    def error(self) -> errors.DsecError | None:
        """None if the operation was done for this sandbox, else the error it met."""
        ...


E = TypeVar("E", bound=BatchEntry)


class DestroyReport(BaseModel):
    """What ``destroy`` did to one sandbox: destroyed it; found nothing to destroy
    (``found`` False: destroyed before, expired, or never yours); or, with ``error`` set,
    could not destroy it now (its node did not answer): it is still there, destroy it again."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str
    found: bool = Field(True, description="there was such a sandbox of yours")
    error: TypedError | None = Field(None, description="why it could not be destroyed now")


class NotCreated(BaseModel):
    """``create``'s entry for a sandbox it could not make, and why (``error``). Nothing of
    it is left behind and it has no id: ``destroy`` takes it as nothing to destroy, the
    other batch calls refuse it (InvalidArgument)."""

    model_config = ConfigDict(extra="forbid")

    error: TypedError


def check(entries: list[E]) -> list[E]:
    """``entries`` if none has an error; else the first one's error raised (same class),
    saying how many more failed: for callers that want all of a batch or an exception."""
    failed = [e.error for e in entries if e.error is not None]
    if not failed:
        return entries
    first = failed[0]
    more = f" (and {len(failed) - 1} more of {len(entries)})" if len(failed) > 1 else ""
    raise type(first)(first.message + more, retryable=first.retryable) from first


def check_one(entry: E) -> E:
    """``entry``, or its error raised: a call on one sandbox raises what a batch reports."""
    if entry.error is not None:
        raise entry.error
    return entry
