""":class:`ClusterState`: typed access to the cluster's buckets, and the one writer of KV.

State changes that can race (a node going down, a sandbox reported lost, a lease lapsing,
a pool's refill claimed) use compare-and-set on the entry's revision: Conflict if another
wrote first.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Callable
from typing import TypeVar

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from dsec_kernel.bus import token_key
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    NAME_PATTERN,
    JobInfo,
    NodeInfo,
    PoolInfo,
    Quota,
    SandboxInfo,
)
from dsec_kernel.state.buckets import (
    JOBS,
    LIVE,
    NODES,
    POOLS,
    QUOTAS,
    SANDBOXES,
    TENANTS,
    get_record,
    open_buckets,
)
from dsec_kernel.state.jetstream import publish_all
from dsec_kernel.state.mirror import Mirror
from dsec_kernel.state.tenants import nats_password, password_hash, tenant_of

__all__ = ["ClusterState"]

T = TypeVar("T")


class ClusterState:
    """Typed access to the buckets. Open it with :meth:`open`."""

    def __init__(self, js: JetStreamContext, kvs: dict[str, KeyValue]) -> None:
        self.js = js
        self.nodes = kvs[NODES]
        self.sandboxes = kvs[SANDBOXES]
        self.tenants = kvs[TENANTS]
        self.jobs = kvs[JOBS]
        self.pools = kvs[POOLS]
        self.quotas = kvs[QUOTAS]

    @classmethod
    async def open(
        cls, nc: NATS, *, replicas: int = 1, create: bool = True, wait_s: float = 30.0
    ) -> ClusterState:
        """Bind the buckets, creating missing ones when ``create`` (needs JetStream). A
        JetStream cluster still electing its leader is waited for, up to ``wait_s``."""
        return cls(*await open_buckets(nc, replicas=replicas, create=create, wait_s=wait_s))

    def mirror(
        self,
        bucket: str,
        parse: Callable[[bytes], T],
        on_change: Callable[[str, T | None], None] | None = None,
    ) -> Mirror[T]:
        """A :class:`~dsec_kernel.state.mirror.Mirror` of ``bucket`` (not started)."""
        return Mirror(self.js, bucket, parse, on_change)

    # -- tenants -----------------------------------------------------------------------------

    async def create_tenant(self, name: str) -> str:
        """Create a credential for tenant ``name`` (the tenant exists once it has one); its
        record keeps the bcrypt hash of its NATS login's password, never the token."""
        if not re.match(NAME_PATTERN, name):
            raise errors.InvalidArgument(
                f"tenant name {name!r} must be letters, digits, '-' or '_' (at most 63)"
            )
        token = "dsec_" + secrets.token_urlsafe(32)
        record = {"tenant": name, "created_at": time.time(), "nats_password": password_hash(token)}
        await self.tenants.create(token_key(token), json.dumps(record).encode())
        return token

    async def tenant(self, key: str) -> str | None:
        """The tenant of the credential stored under ``key`` (``token_key(token)``) as the
        bucket has it now (None if it has none)."""
        hit = await get_record(self.tenants, key, tenant_of)
        return hit[0] if hit else None

    async def adopt_tenant(self, token: str) -> str | None:
        """The tenant of ``token`` if the bucket knows it (None if not), giving a credential
        made before tenants had NATS logins of their own its login."""
        try:
            entry = await self.tenants.get(token_key(token))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        assert entry.value is not None
        record = json.loads(entry.value)
        if "nats_password" not in record:
            record["nats_password"] = password_hash(token)
            await self.tenants.update(token_key(token), json.dumps(record).encode(), entry.revision)
        return record["tenant"]

    async def withdraw_credential(self, token: str) -> None:
        """Delete ``token``'s credential record (its tenant stays while it has others)."""
        await self.tenants.delete(token_key(token))

    async def tenant_logins(self) -> dict[str, str]:
        """``{token key: bcrypt hash}`` of every credential that has a NATS login."""
        mirror: Mirror[str] = self.mirror(TENANTS, nats_password)
        await mirror.start()
        await mirror.stop()
        return {key: hashed for key, (hashed, _) in mirror.items.items()}

    async def remove_tenant(self, name: str) -> int:
        """Delete every credential of tenant ``name``; returns how many (NotFound if none)."""
        mirror: Mirror[str] = self.mirror(TENANTS, tenant_of)
        await mirror.start()
        await mirror.stop()
        keys = [key for key, (tenant, _) in mirror.items.items() if tenant == name]
        if not keys:
            raise errors.NotFound(f"no tenant {name!r} (`dsec tenant create {name}` makes one)")
        for key in keys:
            await self.tenants.delete(key)
        return len(keys)

    async def put_quota(self, tenant: str, quota: Quota) -> int:
        return await self.quotas.put(tenant, quota.model_dump_json().encode())

    # -- jobs --------------------------------------------------------------------------------

    async def get_job(self, key: str) -> tuple[JobInfo, int] | None:
        return await get_record(self.jobs, key, JobInfo.model_validate_json)

    async def cas_job(self, key: str, info: JobInfo, revision: int | None) -> int:
        """Write ``info`` if the record is still at ``revision`` (None: if there is none)."""
        data = info.model_dump_json().encode()
        try:
            if revision is None:
                return await self.jobs.create(key, data)
            return await self.jobs.update(key, data, revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise errors.Conflict(f"job {key} changed meanwhile") from None

    async def delete_job(self, key: str) -> None:
        await self.jobs.delete(key)

    # -- pools -------------------------------------------------------------------------------

    async def put_pool(self, key: str, info: PoolInfo) -> int:
        return await self.pools.put(key, info.model_dump_json().encode())

    async def cas_pool(self, key: str, info: PoolInfo, revision: int) -> int:
        """Write ``info`` only if the record is still at ``revision`` (else Conflict)."""
        try:
            return await self.pools.update(key, info.model_dump_json().encode(), revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise errors.Conflict(f"pool {key} changed meanwhile") from None

    async def delete_pool(self, key: str) -> None:
        await self.pools.delete(key)

    # -- nodes -------------------------------------------------------------------------------

    async def put_node(self, info: NodeInfo) -> int:
        return await self.nodes.put(info.node, info.model_dump_json().encode())

    async def cas_node(self, info: NodeInfo, revision: int) -> int:
        """Write ``info`` only if the record is still at ``revision`` (else Conflict)."""
        try:
            return await self.nodes.update(info.node, info.model_dump_json().encode(), revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise errors.Conflict(f"node {info.node} changed meanwhile") from None

    async def nodes_answer(self) -> None:
        """Return if the nodes bucket's stream answers now (it has a leader); else raise
        what JetStream raised (one of ``bus.STATE_DOWN``)."""
        await self.js.stream_info(f"KV_{NODES}")

    # -- sandboxes ---------------------------------------------------------------------------

    async def put_sandboxes(self, infos: list[SandboxInfo]) -> dict[str, int]:
        """Store many records at once (pipelined publishes); returns id -> revision."""
        msgs = [(f"$KV.{SANDBOXES}.{i.id}", i.model_dump_json().encode(), None) for i in infos]
        seqs = await publish_all(self.js, msgs)
        return {info.id: seq for info, seq in zip(infos, seqs, strict=True)}

    async def get_sandbox(self, sandbox_id: str) -> tuple[SandboxInfo, int] | None:
        return await get_record(self.sandboxes, sandbox_id, SandboxInfo.model_validate_json)

    async def get_sandboxes(self, ids: list[str]) -> dict[str, tuple[SandboxInfo, int]]:
        """The records of ``ids`` that exist (read by key, 64 at a time)."""
        out: dict[str, tuple[SandboxInfo, int]] = {}
        unique = list(dict.fromkeys(ids))
        for i in range(0, len(unique), 64):
            chunk = unique[i : i + 64]
            for sid, hit in zip(
                chunk, await asyncio.gather(*(self.get_sandbox(s) for s in chunk)), strict=True
            ):
                if hit is not None:
                    out[sid] = hit
        return out

    async def cas_sandbox(self, info: SandboxInfo, revision: int) -> int:
        try:
            return await self.sandboxes.update(info.id, info.model_dump_json().encode(), revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise errors.Conflict(f"sandbox {info.id} changed meanwhile") from None

    async def set_sandbox_state(
        self, sandbox_id: str, state: str, paused_reason: str | None = None
    ) -> SandboxInfo | None:
        """Move a live (ready or paused) record to ``state``, retrying on concurrent writes;
        returns the record written, or None if there is none or it is no longer live."""
        for _ in range(10):
            hit = await self.get_sandbox(sandbox_id)
            if hit is None or hit[0].state not in LIVE:
                return None
            info = hit[0].model_copy(update={"state": state, "paused_reason": paused_reason})
            try:
                await self.cas_sandbox(info, hit[1])
                return info
            except errors.Conflict:
                continue
        raise errors.Conflict(f"sandbox {sandbox_id} keeps changing; try again")

    async def delete_sandboxes(self, ids: list[str]) -> None:
        dele = {"KV-Operation": "DEL"}
        await publish_all(self.js, [(f"$KV.{SANDBOXES}.{i}", b"", dele) for i in ids])

    async def scan_sandboxes(self, node: str | None = None) -> dict[str, tuple[SandboxInfo, int]]:
        """Every sandbox record (of ``node`` only, when given), read with a one-off watch."""
        mirror = self.mirror(SANDBOXES, SandboxInfo.model_validate_json)
        await mirror.start()
        await mirror.stop()
        if node is None:
            return mirror.items
        return {k: v for k, v in mirror.items.items() if v[0].node == node}
