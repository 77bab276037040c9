"""Warm pools: ready sandboxes of one spec, kept for a tenant, handed out on acquire."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dsec_kernel.contract.wire.base import Message, Name, SandboxId
from dsec_kernel.contract.wire.sandbox import MAX_BATCH, SandboxInfo, SandboxSpec

__all__ = [
    "AcquireRequest",
    "AcquireResponse",
    "PoolCloseRequest",
    "PoolInfo",
    "PoolOpenRequest",
    "ReleaseRequest",
]


class PoolInfo(Message):
    """A pool's record (KV bucket ``dsec-pools``, key ``<tenant>.<name>``).

    ``target`` is how many idle sandboxes the platform keeps ready: ``size``, raised by
    recent demand (acquires that found the pool empty) up to ``max_size``.
    """

    type: Literal["io.dsec.pool.v1.info"] = "io.dsec.pool.v1.info"
    name: Name
    tenant: Name
    spec: SandboxSpec
    size: int = Field(ge=0, le=MAX_BATCH)
    max_size: int = Field(ge=0, le=10 * MAX_BATCH)
    target: int = 0
    idle: int = Field(0, description="ready in the pool now (as the answering apiserver sees)")
    created_at: float


class PoolOpenRequest(Message):
    """Open a pool (or change its size); the platform fills it in the background."""

    type: Literal["io.dsec.pool.v1.open_request"] = "io.dsec.pool.v1.open_request"
    name: Name
    spec: SandboxSpec
    size: int = Field(ge=0, le=MAX_BATCH)
    max_size: int | None = Field(None, ge=0, le=10 * MAX_BATCH, description="default 4 x size")


class AcquireRequest(Message):
    """Take ready sandboxes from a pool; if it has too few, the rest are created now."""

    type: Literal["io.dsec.pool.v1.acquire_request"] = "io.dsec.pool.v1.acquire_request"
    name: Name
    count: int = Field(1, ge=1, le=MAX_BATCH)


class AcquireResponse(Message):
    type: Literal["io.dsec.pool.v1.acquire_response"] = "io.dsec.pool.v1.acquire_response"
    sandboxes: list[SandboxInfo]
    from_pool: int = Field(0, description="how many were ready in the pool (the rest were made)")


class ReleaseRequest(Message):
    """Give sandboxes back: each is reset to its clean state and returns to the pool (or is
    destroyed if it cannot be reset or the pool is full)."""

    type: Literal["io.dsec.pool.v1.release_request"] = "io.dsec.pool.v1.release_request"
    name: Name
    ids: list[SandboxId] = Field(min_length=1, max_length=MAX_BATCH)


class PoolCloseRequest(Message):
    """Destroy a pool's idle sandboxes and forget it (acquired ones stay). Idempotent."""

    type: Literal["io.dsec.pool.v1.close_request"] = "io.dsec.pool.v1.close_request"
    name: Name
