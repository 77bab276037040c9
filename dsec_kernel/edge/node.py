"""What a node tells the cluster of itself: the record its heartbeat writes."""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter, OrderedDict

from dsec_kernel import __version__
from dsec_kernel.contract.backend import Backend
from dsec_kernel.contract.wire import NodeInfo, NodeLoad
from dsec_kernel.edge.backends import backend_infos
from dsec_kernel.edge.table import SandboxTable

__all__ = ["NodeReport", "RecentLayers"]

#: layers a node's record names at most (the most recently used)
KEPT_LAYERS = 256


class RecentLayers:
    """Layers used on this node, oldest first (placement prefers nodes that have them)."""

    def __init__(self) -> None:
        self._refs: OrderedDict[str, None] = OrderedDict()

    def use(self, refs: list[str]) -> None:
        for ref in refs:
            self._refs[ref] = None
            self._refs.move_to_end(ref)
        while len(self._refs) > KEPT_LAYERS:
            self._refs.popitem(last=False)

    def names(self) -> list[str]:
        return list(self._refs)


class NodeReport:
    """Makes the node's record: its backends, the layers it has, its load."""

    def __init__(
        self,
        node: str,
        pool: str,
        heartbeat_s: float,
        backends: dict[str, Backend],
        table: SandboxTable,
        layers: RecentLayers,
    ) -> None:
        self.node = node
        self.pool = pool
        self.heartbeat_s = heartbeat_s
        self.table = table
        self.layers = layers
        self.edge_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._backends = backend_infos(backends)

    def info(self, running_execs: int) -> NodeInfo:
        """The node's record as of now, ``running_execs`` commands and calls running."""
        cpus = os.cpu_count() or 1
        return NodeInfo(
            node=self.node,
            edge_id=self.edge_id,
            pool=self.pool,
            layers=self.layers.names(),
            backends=self._backends,
            cpus=cpus,
            memory_mb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20,
            load=self._load(running_execs, cpus),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            heartbeat_s=self.heartbeat_s,
            version=__version__,
        )

    def _load(self, running_execs: int, cpus: int) -> NodeLoad:
        by_backend: Counter[str] = Counter()
        paused: Counter[str] = Counter()
        reclaimed = 0
        for rec in self.table.records():
            by_backend[rec.info.backend] += 1
            if rec.paused is not None:
                paused[rec.info.backend] += 1
                reclaimed += rec.reclaimed
        return NodeLoad(
            sandboxes=len(self.table),
            paused=sum(paused.values()),
            reclaimed_mb=reclaimed >> 20,
            paused_by_backend=dict(paused),
            by_backend=dict(by_backend),
            running_execs=running_execs,
            cpu_load=os.getloadavg()[0] / cpus,
            mem_available_mb=_mem_available_mb(),
        )


def _mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0
