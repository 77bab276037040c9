"""What a stopping ``dsec up`` leaves behind, and removing it.

Sandboxes outlive the platform's processes by design (a restarted edge adopts its
containers; fncall sandboxes are directories), so ``up`` says at its stop what stays and how
to remove it, and removes everything first when asked (``dsec up --rm``, ``dsec down``).
Both read every tenant's records with the service login, so nothing is missed for want of a
tenant's token.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import DestroyRequest
from dsec_kernel.contract.wire.sandbox import MAX_BATCH
from dsec_kernel.state.facade import ClusterState

__all__ = ["describe", "remove_all", "scan"]

log = logging.getLogger(__name__)


async def scan(admin_url: str) -> Counter[tuple[str, str]]:
    """How many sandboxes each (tenant, backend) has, from the records."""
    nc = await bus.connect(admin_url, name="dsec-up-leftovers", timeout=5)
    try:
        state = await ClusterState.open(nc, create=False)
        records = await state.scan_sandboxes()
    finally:
        await bus.disconnect(nc)
    return Counter((info.tenant, info.spec.backend) for info, _rev in records.values())


def describe(counts: Counter[tuple[str, str]]) -> str:
    """``3 sandboxes (default: container 2, fncall 1)``."""
    tenants: dict[str, list[str]] = {}
    for (tenant, backend), n in sorted(counts.items()):
        tenants.setdefault(tenant, []).append(f"{backend} {n}")
    parts = "; ".join(f"{t}: {', '.join(b)}" for t, b in tenants.items())
    total = sum(counts.values())
    return f"{total} sandbox{'es' if total != 1 else ''} ({parts})"


async def remove_all(admin_url: str, timeout: float = 60.0) -> int:
    """Destroy every sandbox of every tenant on its edge, then delete its record; returns how
    many were removed. A node that does not answer keeps its records (Unavailable)."""
    nc = await bus.connect(admin_url, name="dsec-up-remove", timeout=5)
    try:
        state = await ClusterState.open(nc, create=False)
        by_node: dict[str, list[str]] = {}
        for info, _rev in (await state.scan_sandboxes()).values():
            by_node.setdefault(info.node, []).append(info.id)
        failed: list[str] = []

        async def one(node: str, ids: list[str]) -> None:
            for i in range(0, len(ids), MAX_BATCH):
                part = ids[i : i + MAX_BATCH]
                data = DestroyRequest(ids=part).model_dump_json().encode()
                try:
                    await bus.request_raw(
                        nc, bus.edge_subject(node, "destroy"), data, timeout=timeout
                    )
                except errors.DsecError as exc:
                    log.warning("node %s did not destroy its sandboxes: %s", node, exc)
                    failed.append(node)
                    return
                await state.delete_sandboxes(part)

        await asyncio.gather(*(one(n, ids) for n, ids in by_node.items()))
    finally:
        await bus.disconnect(nc)
    if failed:
        raise errors.Unavailable(
            f"node(s) {', '.join(sorted(failed))} did not destroy their sandboxes; their "
            "records stay: start dsec up again and run `dsec down`"
        )
    return sum(len(ids) for ids in by_node.values())
