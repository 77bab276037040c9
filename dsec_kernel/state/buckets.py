"""The cluster's KV buckets: their names and layout, and opening them.

Buckets (history 1, file storage, ``replicas`` copies)::

    dsec-nodes       <node>            NodeInfo   rewritten by the node's edge every heartbeat
    dsec-sandboxes   <sandbox id>      SandboxInfo
    dsec-tenants     <token_key(token)> {"tenant": name, "created_at": t,
                                         "nats_password": bcrypt(token)}
    dsec-jobs        <tenant>.<job>    JobInfo    a trainer's lease
    dsec-pools       <tenant>.<pool>   PoolInfo   a warm pool's spec and size
    dsec-quotas      <tenant>          Quota      a tenant's limits
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from dsec_kernel.contract import errors
from dsec_kernel.state.jetstream import ensure_replicas

__all__ = [
    "BUCKETS",
    "JOBS",
    "LIVE",
    "NODES",
    "POOLS",
    "QUOTAS",
    "SANDBOXES",
    "TENANTS",
    "get_record",
    "open_buckets",
]

NODES, SANDBOXES, TENANTS = "dsec-nodes", "dsec-sandboxes", "dsec-tenants"
JOBS, POOLS, QUOTAS = "dsec-jobs", "dsec-pools", "dsec-quotas"
BUCKETS = (NODES, SANDBOXES, TENANTS, JOBS, POOLS, QUOTAS)
#: states of a sandbox that exists on its node
LIVE = ("ready", "paused")
T = TypeVar("T")


async def open_buckets(
    nc: NATS, *, replicas: int, create: bool, wait_s: float
) -> tuple[JetStreamContext, dict[str, KeyValue]]:
    """Bind the buckets, creating missing ones when ``create`` (needs JetStream). A
    JetStream cluster still electing its leader is waited for, up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await _open(nc, replicas, create)
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"JetStream did not answer within {wait_s:g} s ({exc!r}); is nats-server "
                    "running with -js, and does its cluster have a quorum?"
                ) from None
            await asyncio.sleep(0.5)


async def _open(
    nc: NATS, replicas: int, create: bool
) -> tuple[JetStreamContext, dict[str, KeyValue]]:
    js = nc.jetstream(timeout=10)
    kvs: dict[str, KeyValue] = {}
    for bucket in BUCKETS:
        try:
            kvs[bucket] = await js.key_value(bucket)
            if create:
                await ensure_replicas(js, f"KV_{bucket}", replicas)
        except nats.js.errors.BucketNotFoundError:
            if not create:
                raise errors.Unavailable(
                    f"KV bucket {bucket} does not exist; start an apiserver first"
                ) from None
            try:
                kvs[bucket] = await js.create_key_value(
                    bucket=bucket,
                    history=1,
                    replicas=replicas,
                    storage=api.StorageType.FILE,
                )
            except nats.js.errors.BadRequestError:  # another process created it meanwhile
                kvs[bucket] = await js.key_value(bucket)
    return js, kvs


async def get_record(kv: KeyValue, key: str, parse: Callable[[bytes], T]) -> tuple[T, int] | None:
    """A record and its revision, or None if there is none (or it was deleted)."""
    try:
        entry = await kv.get(key)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    assert entry.value is not None and entry.revision is not None
    return parse(entry.value), entry.revision
