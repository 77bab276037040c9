"""Request models built from an SDK call's arguments."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from dsec_kernel import bus
from dsec_kernel.contract import errors

__all__ = ["build_request"]

M = TypeVar("M", bound=BaseModel)

#: wire fields the SDK's methods take under other names
_ARGUMENT_NAMES = {"timeout_s": "timeout", "ttl_s": "ttl", "idle_ttl_s": "idle_ttl",
                   "wait_s": "wait", "sandbox_ids": "sandboxes"}  # fmt: skip


def build_request(cls: type[M], **fields: object) -> M:
    """Build a request model; bad arguments raise InvalidArgument naming the argument as the
    caller gave it (``timeout: must be > 0``)."""
    try:
        return cls(**fields)
    except ValidationError as exc:
        raise errors.InvalidArgument(bus.validation_message(exc, _ARGUMENT_NAMES)) from None
