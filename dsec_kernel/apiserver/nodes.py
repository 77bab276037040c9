"""The nodes as this apiserver sees them.

A :class:`~dsec_kernel.contract.placement.NodeView` per node: its last record (from KV
``dsec-nodes``, rewritten by its edge's heartbeats) plus the sandboxes this apiserver
placed on it that those heartbeats may not count yet. Also when each node was last heard
from (for :mod:`.liveness`), and an event per node, set while it is down, that calls to its
edge wait on (:mod:`.edges`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

from dsec_kernel.contract.placement import NodeView
from dsec_kernel.contract.wire import NodeInfo, SandboxInfo
from dsec_kernel.state.buckets import NODES
from dsec_kernel.state.facade import ClusterState

__all__ = ["Nodes", "Placed"]


@dataclass
class Placed:
    """Sandboxes this apiserver placed on a node that its heartbeats may not count yet:
    until one stamped at or after ``done_at`` (the edge's clock) arrives."""

    backend: str
    count: int
    done_at: float = math.inf
    ids: set[str] = field(default_factory=set)


class Nodes:
    """The node views; see the module docstring. ``on_room()`` is called whenever a node's
    room may have changed (a heartbeat, a sandbox gone)."""

    def __init__(self, state: ClusterState, on_room: Callable[[], None]) -> None:
        self.mirror = state.mirror(NODES, NodeInfo.model_validate_json, self.changed)
        self.views: dict[str, NodeView] = {}
        self.seen: dict[str, float] = {}  # node -> when a new heartbeat last came
        self._on_room = on_room
        self._down: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._placed: dict[str, list[Placed]] = defaultdict(list)

    def view_all(self) -> None:
        """A view of every node the mirror holds (once it has loaded), each given a full
        timeout from now: a fresh apiserver has heard nothing yet."""
        now = time.monotonic()
        for name, (info, _) in self.mirror.items.items():
            self.views[name] = NodeView(info)
            self.seen[name] = now

    def heard_from_all(self) -> None:
        """Count every node's silence again from now."""
        now = time.monotonic()
        for name in self.seen:
            self.seen[name] = now

    def down_event(self, node: str) -> asyncio.Event:
        """Set while ``node`` is marked down."""
        return self._down[node]

    def backends(self) -> list[str]:
        """The names of the backends the nodes run."""
        return sorted({b.name for v in self.views.values() for b in v.info.backends})

    def changed(self, name: str, info: NodeInfo | None) -> None:
        """The mirror's callback for every change of a node's record."""
        if info is None:
            self.views.pop(name, None)
            return
        view = self.views.get(name)
        if view is None or (info.heartbeat_at, info.alive_at) != (
            view.info.heartbeat_at, view.info.alive_at,
        ):  # fmt: skip
            self.seen[name] = time.monotonic()
        if view is None:
            view = self.views[name] = NodeView(info)
        view.info = info
        if info.state == "down":
            self._down[name].set()  # calls waiting on this node fail now
        elif self._down[name].is_set():
            self._down[name] = asyncio.Event()  # back up: later calls wait on a fresh event
        # placements a heartbeat already counts go (both times are the edge's clock)
        self._placed[name] = [p for p in self._placed[name] if p.done_at > info.heartbeat_at]
        self._recount(name)
        self._on_room()

    # -- placements --------------------------------------------------------------------------

    def place(self, node: str, backend: str, count: int) -> Placed:
        """Count ``count`` sandboxes of ``backend`` as pending on ``node`` from now."""
        placed = Placed(backend, count)
        self._placed[node].append(placed)
        self._recount(node)
        return placed

    def unplace(self, node: str, placed: Placed) -> None:
        """Its create failed: ``placed`` counts no more."""
        with suppress(ValueError):
            self._placed[node].remove(placed)
        self._recount(node)

    def made(self, node: str, placed: Placed, made: list[SandboxInfo], done_at: float) -> None:
        """The edge made ``made`` of ``placed``, its answer stamped ``done_at``."""
        placed.count, placed.done_at = len(made), done_at
        placed.ids = {info.id for info in made}
        self._recount(node)

    def left(self, infos: list[SandboxInfo]) -> None:
        """Count destroyed sandboxes out of their nodes' load now, not at the next heartbeat
        (which then brings the node's own figures), so that queued creates get their room."""
        for info in infos:
            self._left(info)
        self._on_room()

    def _left(self, info: SandboxInfo) -> None:
        view = self.views.get(info.node)
        if view is None:
            return
        for placed in self._placed[info.node]:  # not in a heartbeat yet: counted as pending
            if info.id in placed.ids:
                placed.ids.discard(info.id)
                placed.count -= 1
                self._recount(info.node)
                return
        load = view.info.load
        load.by_backend[info.backend] = max(0, load.by_backend.get(info.backend, 0) - 1)
        if info.state == "paused":
            paused = load.paused_by_backend
            paused[info.backend] = max(0, paused.get(info.backend, 0) - 1)

    def _recount(self, node: str) -> None:
        view = self.views.get(node)
        if view is not None:
            view.pending = {}
            for p in self._placed[node]:
                view.pending[p.backend] = view.pending.get(p.backend, 0) + p.count
