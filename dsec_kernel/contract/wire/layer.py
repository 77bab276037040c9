"""Pre-staging layers on the nodes of a pool (e.g. the ``cloud`` pool before a burst)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dsec_kernel.contract.wire.base import Message, Name
from dsec_kernel.contract.wire.sandbox import Failure, LayerRef

__all__ = ["PrestageRequest", "PrestageResponse"]


class PrestageRequest(Message):
    """Have the nodes of ``pool`` (every node, if None) mount these layers and read their
    metadata now, so the first sandboxes there start as on a warm node. A node keeps them
    staged until its edge stops; placement counts them as cached there."""

    type: Literal["io.dsec.layer.v1.prestage_request"] = "io.dsec.layer.v1.prestage_request"
    layers: list[LayerRef] = Field(min_length=1, max_length=64)
    pool: Name | None = None
    tenant: Name | None = Field(None, description="set by the apiserver")


class PrestageResponse(Message):
    type: Literal["io.dsec.layer.v1.prestage_response"] = "io.dsec.layer.v1.prestage_response"
    nodes: list[str] = Field(default_factory=list, description="nodes that staged them all")
    failed: list[Failure] = Field(default_factory=list, description="per node (id = node)")
