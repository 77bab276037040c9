"""Node liveness: nodes whose heartbeats stop are marked down, and their sandboxes lost.

Every apiserver watches; the first to mark a node down (compare-and-set on its record)
reports that node's sandboxes lost (``dsec_node_down``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import suppress

from dsec_kernel import bus
from dsec_kernel.apiserver.nodes import Nodes
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import NodeInfo
from dsec_kernel.state.buckets import LIVE
from dsec_kernel.state.facade import ClusterState

__all__ = ["Liveness"]

log = logging.getLogger(__name__)


class Liveness:
    """Its periodic :meth:`check` marks silent nodes down; see the module docstring."""

    def __init__(
        self,
        settings: ApiSettings,
        state: ClusterState,
        nodes: Nodes,
        registry: Registry,
        hooks: Hooks,
    ) -> None:
        self.settings = settings
        self.state = state
        self.nodes = nodes
        self.registry = registry
        self.hooks = hooks
        self._state_was_down = False  # a node-down write found no stream leader

    async def check(self) -> None:
        """Mark nodes down whose heartbeats stopped, and report lost every ready sandbox on a
        down node (including records written after the node went down)."""
        now = time.monotonic()
        if self._state_was_down:  # heartbeats could not be stored either: silence counts
            try:  # again from when the nodes bucket answers
                await self.state.nodes_answer()
            except bus.STATE_DOWN:
                return
            self._state_was_down = False
            self.nodes.heard_from_all()
            return
        records = self.nodes.mirror.items
        seen = self.nodes.seen
        newly_down: list[tuple[NodeInfo, float]] = []
        for name, (info, rev) in list(records.items()):
            silent = now - seen.get(name, now)
            grace = self.settings.restart_grace_s if info.stopping_since else None
            if info.state != "up" or silent < (grace or self.settings.node_timeout_s):
                continue
            down = info.model_copy(update={"state": "down"})
            try:
                await self.state.cas_node(down, rev)
            except errors.Conflict:
                continue  # it heartbeated meanwhile, or another apiserver took it
            except bus.STATE_DOWN:  # the nodes bucket is between leaders: so were heartbeats
                self._state_was_down = True
                return
            newly_down.append((down, silent))
        down_nodes = {n for n, (info, _) in records.items() if info.state == "down"}
        down_nodes |= {d.node for d, _ in newly_down}
        lost: dict[str, list[str]] = defaultdict(list)
        for node in down_nodes:
            for sid in self.registry.on_node(node):
                hit = self.registry.items.get(sid)
                if hit is None or hit[0].state not in LIVE:
                    continue
                with suppress(errors.Conflict):
                    await self.state.cas_sandbox(
                        hit[0].model_copy(update={"state": "lost"}), hit[1]
                    )
                    lost[node].append(sid)
        for down, silent in newly_down:
            log.warning(
                "node %s silent for %.1fs: down, %d sandbox(es) lost",
                down.node,
                silent,
                len(lost[down.node]),
            )
            await self.hooks.node_down(down, lost[down.node])
