"""The sandbox registry: this apiserver's copy of the sandbox records and its indexes.

The copy is a mirror of KV ``dsec-sandboxes``, kept current by a watch and, for what this
apiserver writes itself, at once (:meth:`Registry.record`, :meth:`Registry.forget`). Its
indexes follow every change: sandboxes by node, by tenant, by (tenant, request id), by
(tenant, job) and how many of a job run on each node, and a heap of expiries. Other parts
that index sandboxes (pools, admission) :meth:`~Registry.watch` the same changes.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from dsec_kernel.contract import errors
from dsec_kernel.contract.placement import NodeView
from dsec_kernel.contract.wire import SandboxInfo
from dsec_kernel.state.buckets import LIVE, SANDBOXES
from dsec_kernel.state.facade import ClusterState

__all__ = ["Registry", "Watcher"]

#: called with a sandbox id and its record (None: it is gone) on every change
Watcher = Callable[[str, SandboxInfo | None], None]


class Registry:
    """The sandbox records and their indexes; see the module docstring. ``views`` (the
    node views, read only) tell a sandbox on a node that is down as lost."""

    def __init__(self, state: ClusterState, views: dict[str, NodeView]) -> None:
        self.state = state
        self.views = views
        self.mirror = state.mirror(SANDBOXES, SandboxInfo.model_validate_json, self.indexed)
        #: sandbox id -> (record, revision): the mirror's own dict (it is never replaced)
        self.items = self.mirror.items
        self._watchers: list[Watcher] = []
        self._by_node: dict[str, set[str]] = defaultdict(set)  # node -> sandbox ids
        self._node_of: dict[str, str] = {}  # sandbox id -> the node _by_node has it under
        self._by_tenant: dict[str, set[str]] = defaultdict(set)  # tenant -> sandbox ids
        self._tenant_of: dict[str, str] = {}  # sandbox id -> tenant
        self._job_nodes: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self._job_of: dict[str, tuple[tuple[str, str], str]] = {}  # id -> ((tenant, job), node)
        self._job_members: dict[tuple[str, str], set[str]] = defaultdict(set)  # (tenant, job)
        self._by_request: dict[tuple[str, str], set[str]] = defaultdict(set)  # (tenant, rid)
        self._request_of: dict[str, tuple[str, str]] = {}  # sandbox id -> (tenant, rid)
        self._expiries: list[tuple[float, str]] = []  # heap of (expires_at, sandbox id)
        self._expiry_of: dict[str, float] = {}  # sandbox id -> the expiry pushed for it

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher`` on every change from now (before the registry's own indexes)."""
        self._watchers.append(watcher)

    def index_all(self) -> None:
        """Index every record the mirror holds (once it has loaded)."""
        for sid, (info, _) in self.items.items():
            self.indexed(sid, info)

    # -- changes -----------------------------------------------------------------------------

    def record(self, infos: Iterable[SandboxInfo], revisions: dict[str, int]) -> None:
        """Mirror records this apiserver just wrote (at ``revisions``, by id) at once."""
        for info in infos:
            self.items[info.id] = (info, revisions[info.id])
            self.indexed(info.id, info)

    def forget(self, infos: Iterable[SandboxInfo]) -> None:
        """Drop records this apiserver just deleted at once."""
        for info in infos:
            self.items.pop(info.id, None)
            self.indexed(info.id, None)

    def indexed(self, sandbox_id: str, info: SandboxInfo | None) -> None:
        """Keep the indexes in step with the mirror (its callback for every change)."""
        for watcher in self._watchers:
            watcher(sandbox_id, info)
        expiry = info.expires_at if info is not None else None
        if expiry is not None and self._expiry_of.get(sandbox_id) != expiry:
            self._expiry_of[sandbox_id] = expiry
            heapq.heappush(self._expiries, (expiry, sandbox_id))
        if info is not None and info.request_id:
            self._request_of[sandbox_id] = (info.tenant, info.request_id)
            self._by_request[(info.tenant, info.request_id)].add(sandbox_id)
        if info is None:
            self._expiry_of.pop(sandbox_id, None)
            if (tenant := self._tenant_of.pop(sandbox_id, None)) is not None:
                self._by_tenant[tenant].discard(sandbox_id)
                if not self._by_tenant[tenant]:
                    del self._by_tenant[tenant]
            if (node := self._node_of.pop(sandbox_id, None)) is not None:
                self._by_node[node].discard(sandbox_id)  # (not every node's: 160 of them)
            if (req := self._request_of.pop(sandbox_id, None)) is not None:
                self._by_request[req].discard(sandbox_id)
                if not self._by_request[req]:
                    del self._by_request[req]
            if (old := self._job_of.pop(sandbox_id, None)) is not None:
                self._job_nodes[old[0]][old[1]] -= 1
                self._job_members[old[0]].discard(sandbox_id)
                if not self._job_members[old[0]]:
                    del self._job_members[old[0]]
            return
        if (was := self._node_of.get(sandbox_id)) != info.node:  # new, or moved (recovered)
            if was is not None:
                self._by_node[was].discard(sandbox_id)
            self._node_of[sandbox_id] = info.node
            self._by_node[info.node].add(sandbox_id)
        self._tenant_of[sandbox_id] = info.tenant
        self._by_tenant[info.tenant].add(sandbox_id)
        if info.job and sandbox_id not in self._job_of:
            key = (info.tenant, info.job)
            self._job_of[sandbox_id] = (key, info.node)
            self._job_nodes[key][info.node] += 1
            self._job_members[key].add(sandbox_id)

    # -- reading -----------------------------------------------------------------------------

    def on_node(self, node: str) -> list[str]:
        return list(self._by_node.get(node, ()))

    def of_tenant(self, tenant: str) -> Iterable[str]:
        return self._by_tenant.get(tenant, ())

    def job_nodes(self, tenant: str, job: str) -> dict[str, int]:
        """How many of the job's sandboxes are on each node."""
        return dict(self._job_nodes[(tenant, job)])

    def job_members(self, tenant: str, job: str, states: tuple[str, ...] = ()) -> list[SandboxInfo]:
        """The job's sandboxes (those in ``states`` only, when given)."""
        hits = (self.items.get(sid) for sid in list(self._job_members.get((tenant, job), ())))
        return [h[0] for h in hits if h is not None and (not states or h[0].state in states)]

    def created_by(self, tenant: str, request_id: str) -> list[SandboxInfo]:
        """The sandboxes a create with ``request_id`` made, by id."""
        ids = self._by_request.get((tenant, request_id), ())
        hits = [self.items.get(i) for i in sorted(ids)]
        return [h[0] for h in hits if h is not None]

    def expired(self, now: float) -> list[SandboxInfo]:
        """Sandboxes past their expiry at ``now``, taken off the heap of expiries (stale
        entries, of sandboxes gone or seen twice, are skipped)."""
        due: dict[str, SandboxInfo] = {}
        while self._expiries and self._expiries[0][0] < now:
            _, sid = heapq.heappop(self._expiries)
            hit = self.items.get(sid)
            if hit is not None and hit[0].expires_at is not None and hit[0].expires_at < now:
                due[sid] = hit[0]
        return list(due.values())

    def expire_again(self, infos: Iterable[SandboxInfo], now: float) -> None:
        """Put those of ``infos`` still here back on the heap (to be tried again)."""
        for info in infos:
            if info.id in self.items:
                heapq.heappush(self._expiries, (info.expires_at or now, info.id))

    async def lookup(self, tenant: str, sandbox_id: str, allow_lost: bool = False) -> SandboxInfo:
        """The caller's sandbox, or NotFound / SandboxLost (unless ``allow_lost``)."""
        info = self.mirror.get(sandbox_id)
        if info is None:
            hit = await self.state.get_sandbox(sandbox_id)  # created through another apiserver
            info = hit[0] if hit else None
        if info is None or info.tenant != tenant:
            raise errors.NotFound(f"no sandbox {sandbox_id} (destroyed, expired, or not yours)")
        view = self.views.get(info.node)
        if info.state in LIVE and view is not None and view.info.state == "down":
            info = info.model_copy(update={"state": "lost"})  # its record is being marked
        if info.state == "lost" and not allow_lost:
            raise errors.SandboxLost(
                f"sandbox {sandbox_id} was lost when node {info.node} went down; create a new one"
            )
        return info
