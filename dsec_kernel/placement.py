"""Placement: which node gets each sandbox of a create request.

A placement policy is a class under the ``dsec.placement`` entry-point group; the apiserver
loads the one configured (``least-loaded`` by default). Policies see :class:`NodeView` s
(a node's last heartbeat plus what this apiserver placed there since) and may be refined by
the ``dsec_placement_filter`` / ``dsec_placement_score`` hooks of any plugin.
"""

from __future__ import annotations

import abc
import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsec_kernel import errors

if TYPE_CHECKING:
    from dsec_kernel.plugins import Hooks
    from dsec_kernel.wire import NodeInfo, SandboxSpec

__all__ = ["LeastLoaded", "NodeView", "PlacementPolicy", "PlacementRequest"]


@dataclass(frozen=True)
class PlacementRequest:
    """What is being placed: ``count`` sandboxes of ``spec`` for ``tenant``."""

    tenant: str
    spec: SandboxSpec
    count: int


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
        return self.info.load.by_backend.get(backend, 0) + self.pending.get(backend, 0)

    def free(self, backend: str) -> int:
        return max(0, self.capacity(backend) - self.used(backend))


class PlacementPolicy(abc.ABC):
    """Chooses nodes. ``place`` must be fast: it runs inside every create request."""

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks

    def candidates(self, request: PlacementRequest, nodes: list[NodeView]) -> list[NodeView]:
        """Nodes that are up, run the backend, have room and pass every plugin's filter."""
        backend = request.spec.backend
        return [
            n
            for n in nodes
            if n.info.state == "up"
            and n.free(backend) > 0
            and self.hooks.placement_filter(n, request)
        ]

    @abc.abstractmethod
    def place(self, request: PlacementRequest, nodes: list[NodeView]) -> list[str]:
        """One node name per sandbox (``request.count`` of them).

        Raises :class:`~dsec_kernel.errors.CapacityExceeded` when the nodes cannot take them
        all. Does not change ``nodes``; the caller records the placements.
        """


class LeastLoaded(PlacementPolicy):
    """Each sandbox goes to the node with the lowest fill ratio for its backend.

    Ratio = sandboxes / capacity, so nodes of different sizes fill evenly; plugin scores are
    added (a score of 1.0 outweighs a completely full node). Ties go to the lower CPU load.
    """

    def place(self, request: PlacementRequest, nodes: list[NodeView]) -> list[str]:
        backend = request.spec.backend
        cands = self.candidates(request, nodes)
        free = {n.name: n.free(backend) for n in cands}
        if sum(free.values()) < request.count:
            raise errors.CapacityExceeded(
                f"no room for {request.count} {backend} sandboxes: "
                f"{sum(free.values())} free on {len(cands)} node(s); retry later or add nodes"
            )
        heap: list[tuple[float, float, str, int, int, float]] = []
        for n in cands:
            cap = n.capacity(backend)
            bonus = self.hooks.placement_score(n, request)
            used = n.used(backend)
            heap.append((used / cap - bonus, n.info.load.cpu_load, n.name, used, cap, bonus))
        heapq.heapify(heap)
        out: list[str] = []
        for _ in range(request.count):
            _, cpu, name, used, cap, bonus = heapq.heappop(heap)
            out.append(name)
            used += 1
            free[name] -= 1
            if free[name] > 0:
                heapq.heappush(heap, ((used / cap) - bonus, cpu, name, used, cap, bonus))
        return out
