"""The placement policies DSec ships: ``least-loaded`` (the usual choice), ``bin-pack`` and
``spread-by-job``, each a :class:`~dsec_kernel.contract.placement.PlacementPolicy` under the
``dsec.placement`` entry-point group.

Every one of them also

* prefers nodes that have the sandbox's layers cached (``locality_weight``), and
* bursts: nodes in the ``burst_pool`` (e.g. ``cloud``) take sandboxes only once the other
  nodes are ``burst_threshold`` full (or cannot take them all); then they are preferred.
"""

from __future__ import annotations

import abc
import heapq

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract import errors
from dsec_kernel.contract.placement import NodeView, PlacementPolicy, PlacementRequest
from dsec_kernel.contract.wire.sandbox import LayerRef

__all__ = ["BinPack", "LeastLoaded", "ScoredConfig", "ScoredPolicy", "SpreadByJob"]


class ScoredConfig(BaseModel):
    """``DSEC_PLACEMENT_CONFIG__<FIELD>``: what every policy of this plugin takes."""

    model_config = ConfigDict(extra="forbid")

    burst_pool: str = Field("cloud", description="the node pool that takes overflow")
    burst_threshold: float = Field(
        0.8, gt=0, le=1, description="fill of the other pools past which new sandboxes burst"
    )
    locality_weight: float = Field(
        0.25, ge=0, description="bonus for a node with all the sandbox's layers cached"
    )


class ScoredPolicy(PlacementPolicy):
    """Places one sandbox at a time on the node with the lowest :meth:`score`, after the
    burst rule has chosen which nodes may take them. Subclasses define ``score``."""

    Config = ScoredConfig
    config: ScoredConfig

    @abc.abstractmethod
    def score(self, request: PlacementRequest, node: NodeView, used: int, cap: int) -> float:
        """Lower is better; ``used`` counts the sandboxes placed so far in this request."""

    def place(self, request: PlacementRequest, nodes: list[NodeView]) -> list[str]:
        backend = request.spec.backend
        cands = self.candidates(request, nodes)
        free = {n.name: n.free(backend) for n in cands}
        if sum(free.values()) < request.count:
            raise errors.CapacityExceeded(
                f"no room for {request.count} {backend} sandboxes: "
                f"{sum(free.values())} free on {len(cands)} node(s); retry later or add nodes"
            )
        cands = self._burst(request, nodes, cands, free)
        refs = request.spec.env.refs() if request.spec.env else []
        bonus = {n.name: self._bonus(request, n, refs) for n in cands}
        counts = dict(request.job_counts)
        heap = []
        for n in cands:
            used, cap = n.used(backend), n.capacity(backend)
            heap.append((self.score(request, n, used, cap) - bonus[n.name], n.name, n, used, cap))
        heapq.heapify(heap)
        out: list[str] = []
        for _ in range(request.count):
            _, name, n, used, cap = heapq.heappop(heap)
            out.append(name)
            used += 1
            free[name] -= 1
            counts[name] = counts.get(name, 0) + 1
            if free[name] > 0:
                placed = PlacementRequest(request.tenant, request.spec, request.count, counts)
                s = self.score(placed, n, used, cap) - bonus[name]
                heapq.heappush(heap, (s, name, n, used, cap))
        return out

    @staticmethod
    def pressure(node: NodeView) -> float:
        """A penalty from the node's heartbeat: nothing while its memory is under 80 % used
        and its CPUs are not overloaded, then up to 0.5 for memory (at 100 %) plus 0.5 per
        unit of load above one per CPU (a completely full node scores 1.0); below that only
        breaks ties."""
        info = node.info
        used_mem = 1 - info.load.mem_available_mb / info.memory_mb if info.memory_mb else 0.0
        cpu = info.load.cpu_load
        penalty = 2.5 * max(0.0, used_mem - 0.8) + 0.5 * max(0.0, cpu - 1.0)
        return penalty + 1e-9 * (cpu + used_mem)

    def _bonus(self, request: PlacementRequest, node: NodeView, refs: list[LayerRef]) -> float:
        bonus = self.hooks.placement_score(node, request)
        if refs and self.config.locality_weight:
            cached = set(node.info.layers)  # as the node lists them: public, or the tenant's
            hits = sum(
                r.listed_as(None) in cached or r.listed_as(request.tenant) in cached for r in refs
            )
            bonus += self.config.locality_weight * hits / len(refs)
        return bonus

    def _burst(
        self,
        request: PlacementRequest,
        nodes: list[NodeView],
        cands: list[NodeView],
        free: dict[str, int],
    ) -> list[NodeView]:
        """The nodes this request may use: the burst pool's only once the other pools
        (all their nodes that are up, full ones too) are past the threshold."""
        backend = request.spec.backend
        burst = [n for n in cands if n.info.pool == self.config.burst_pool]
        home = [n for n in cands if n.info.pool != self.config.burst_pool]
        if not burst or not home:
            return cands
        pools = [n for n in nodes if n.info.serving and n.info.pool != self.config.burst_pool]
        cap = sum(n.capacity(backend) for n in pools)
        fill = sum(n.used(backend) for n in pools) / cap if cap else 1.0
        if fill >= self.config.burst_threshold:
            room = sum(free[n.name] for n in burst)
            return burst if room >= request.count else cands
        room = sum(free[n.name] for n in home)
        return home if room >= request.count else cands


class LeastLoaded(ScoredPolicy):
    """Each sandbox goes to the node with the lowest fill ratio for its backend.

    Ratio = sandboxes / capacity, so nodes of different sizes fill evenly; plugin scores and
    the locality bonus are subtracted (a score of 1.0 outweighs a completely full node).
    Nodes short of memory or overloaded score worse (:meth:`pressure`).
    """

    preference = 10  # the policy of a cluster whose operator names none

    def score(self, request: PlacementRequest, node: NodeView, used: int, cap: int) -> float:
        return used / cap + self.pressure(node)


class BinPack(ScoredPolicy):
    """Fill the fullest node that still has room first, so whole nodes stay free (to be
    drained, turned off, or given to large jobs)."""

    def score(self, request: PlacementRequest, node: NodeView, used: int, cap: int) -> float:
        return -used / cap


class SpreadByJob(ScoredPolicy):
    """Spread one job's sandboxes over as many nodes as possible (a node failure costs the
    job little); among nodes holding as many of the job, the least loaded. Sandboxes
    without a job are placed as by least-loaded."""

    def score(self, request: PlacementRequest, node: NodeView, used: int, cap: int) -> float:
        mine = request.job_counts.get(node.name, 0) if request.spec.job else 0
        return mine + used / cap + self.pressure(node)
