"""Placement: which node gets each sandbox of a create request.

A placement policy is a :class:`PlacementPolicy` subclass under the ``dsec.placement``
entry-point group, with a pydantic ``Config`` (``DSEC_PLACEMENT_CONFIG__<FIELD>``, validated
when the apiserver loads it; the policy named by ``DSEC_PLACEMENT``). Policies see
:class:`NodeView` s (a node's last heartbeat plus what this apiserver placed there since) and
should let the ``dsec_placement_filter`` / ``dsec_placement_score`` hooks of any plugin refine
their choice (:meth:`PlacementPolicy.candidates` applies the filters).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from pydantic import BaseModel

from dsec_kernel.contract.config import NoConfig

if TYPE_CHECKING:
    from dsec_kernel.contract.wire import NodeInfo, SandboxSpec

__all__ = ["NodeView", "PlacementHooks", "PlacementPolicy", "PlacementRequest"]


@dataclass(frozen=True)
class PlacementRequest:
    """What is being placed: ``count`` sandboxes of ``spec`` for ``tenant``;
    ``job_counts``: how many sandboxes of the spec's job each node holds already."""

    tenant: str
    spec: SandboxSpec
    count: int
    job_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class NodeView:
    """A node as placement sees it: its last heartbeat plus placements made since."""

    info: NodeInfo
    pending: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.info.node

    def capacity(self, backend: str) -> int:
        b = self.info.backend(backend)
        return b.capabilities.max_sandboxes if b else 0

    def used(self, backend: str) -> int:
        """Running sandboxes of ``backend`` (paused ones, their memory reclaimed, do not
        count) plus those placed since the heartbeat."""
        load = self.info.load
        running = load.by_backend.get(backend, 0) - load.paused_by_backend.get(backend, 0)
        return running + self.pending.get(backend, 0)

    def free(self, backend: str) -> int:
        return max(0, self.capacity(backend) - self.used(backend))


class PlacementHooks(Protocol):
    """What a policy may ask of the plugins (the kernel's hooks facade is one): every
    plugin's ``dsec_placement_filter`` and ``dsec_placement_score`` for a node."""

    def placement_filter(self, node: NodeView, request: PlacementRequest) -> bool: ...

    def placement_score(self, node: NodeView, request: PlacementRequest) -> float: ...


class PlacementPolicy(abc.ABC):
    """Chooses nodes. ``place`` must be fast: it runs inside every create request."""

    Config: ClassVar[type[BaseModel]] = NoConfig
    preference: ClassVar[int] = 100  # the lowest installed runs when none is named

    def __init__(self, config: BaseModel, hooks: PlacementHooks) -> None:
        self.config = config
        self.hooks = hooks

    def candidates(self, request: PlacementRequest, nodes: list[NodeView]) -> list[NodeView]:
        """Nodes that are up, run the backend, have room and pass every plugin's filter."""
        backend = request.spec.backend
        return [
            n
            for n in nodes
            if n.info.serving and n.free(backend) > 0 and self.hooks.placement_filter(n, request)
        ]

    @abc.abstractmethod
    def place(self, request: PlacementRequest, nodes: list[NodeView]) -> list[str]:
        """One node name per sandbox (``request.count`` of them).

        Raises :class:`~.errors.CapacityExceeded` when the nodes cannot take them
        all. Does not change ``nodes``; the caller records the placements.
        """
