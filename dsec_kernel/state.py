"""Cluster state in JetStream KV: nodes, sandboxes and tenants.

Buckets (history 1, file storage, ``replicas`` copies)::

    dsec-nodes       <node>            NodeInfo   rewritten by the node's edge every heartbeat
    dsec-sandboxes   <sandbox id>      SandboxInfo
    dsec-tenants     <token_key(token)> {"tenant": name, "created_at": t,
                                         "nats_password": bcrypt(token)}
    dsec-jobs        <tenant>.<job>    JobInfo    a trainer's lease
    dsec-pools       <tenant>.<pool>   PoolInfo   a warm pool's spec and size
    dsec-quotas      <tenant>          Quota      a tenant's limits

State changes that can race (a node going down, a sandbox reported lost) use compare-and-set
on the entry's revision. :class:`Mirror` keeps an in-memory copy of a bucket from a watch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import bcrypt
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from dsec_kernel.bus import token_key
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import NAME_PATTERN, JobInfo, NodeInfo, SandboxInfo

__all__ = [
    "BUCKETS",
    "JOBS",
    "LIVE",
    "POOLS",
    "QUOTAS",
    "TENANTS",
    "ClusterState",
    "Mirror",
    "nats_password",
    "password_hash",
]

log = logging.getLogger(__name__)

NODES, SANDBOXES, TENANTS = "dsec-nodes", "dsec-sandboxes", "dsec-tenants"
JOBS, POOLS, QUOTAS = "dsec-jobs", "dsec-pools", "dsec-quotas"
BUCKETS = (NODES, SANDBOXES, TENANTS, JOBS, POOLS, QUOTAS)
#: states of a sandbox that exists on its node
LIVE = ("ready", "paused")
# A mirror's watch is recreated after two heartbeats missed: a stream whose leader was lost
# (its consumer with it) is followed again within seconds of the next leader's election,
# not after nats-py's default 2 x 5 s (each attempt during the election fails and waits
# another round).
MIRROR_HEARTBEAT_S = 1.0
ACK_SILENCE_S = 2.0  # no JetStream ack for this long: the message is sent again
T = TypeVar("T")
#: bcrypt's work factor for NATS passwords. The lowest: a token holds 256 random bits, so
#: slowness adds nothing against guessing, and nats-server checks the hash on every connect
#: (~1 ms at 4, ~80 ms at 10: a flood of logins would cost the server that much each).
BCRYPT_COST = 4


def password_hash(password: str) -> str:
    """The bcrypt hash nats-server checks ``password`` against."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()


def nats_password(record: bytes) -> str | None:
    """The NATS password hash in a tenants record (None: a credential made before tenants
    had NATS logins of their own; it has no login until its token is adopted again)."""
    value = json.loads(record).get("nats_password")
    return value if isinstance(value, str) else None


class Mirror(Generic[T]):
    """An in-memory copy of a KV bucket, kept current by an ordered-consumer watch.

    ``items`` maps key -> (value, revision). ``on_change(key, value | None)`` is called for
    every update after the initial load. :meth:`start` returns once the bucket's current
    content has been loaded.
    """

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        parse: Callable[[bytes], T],
        on_change: Callable[[str, T | None], None] | None = None,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.parse = parse
        self.on_change = on_change
        self.items: dict[str, tuple[T, int]] = {}
        self._prefix = f"$KV.{bucket}."
        self._loaded = asyncio.Event()
        self._sub = None
        self.seq = 0  # the bucket's last change this copy has
        self._moved = asyncio.Event()

    async def start(self) -> None:
        async def on_msg(msg) -> None:
            key = msg.subject[len(self._prefix) :]
            meta = msg.metadata
            op = msg.headers.get("KV-Operation") if msg.headers else None
            if op in ("DEL", "PURGE") or (msg.headers and "Nats-Marker-Reason" in msg.headers):
                self.items.pop(key, None)
                value = None
            else:
                try:
                    value = self.parse(msg.data)
                except Exception as exc:  # a record we cannot read is skipped, not fatal
                    log.warning("skipping unreadable %s/%s: %s", self.bucket, key, exc)
                    value = None
                if value is not None:
                    self.items[key] = (value, meta.sequence.stream)
            self.seq = max(self.seq, meta.sequence.stream)
            self._moved.set()
            if self._loaded.is_set():
                if self.on_change:
                    self.on_change(key, value)
            elif meta.num_pending == 0:
                self._loaded.set()

        deadline = time.monotonic() + 30.0  # a JetStream cluster may still be electing leaders
        while True:
            try:
                self._sub = await self.js.subscribe(
                    f"{self._prefix}>",
                    cb=on_msg,
                    ordered_consumer=True,
                    idle_heartbeat=MIRROR_HEARTBEAT_S,
                    deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
                    inactive_threshold=300,
                    pending_msgs_limit=-1,
                    pending_bytes_limit=-1,
                )
                info = await self._sub.consumer_info()
                break
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                await self.stop()
                if time.monotonic() > deadline:
                    raise errors.Unavailable(
                        f"JetStream does not serve the {self.bucket} bucket (no quorum?)"
                    ) from None
                await asyncio.sleep(0.5)
        # empty only if the server has nothing pending *and* sent nothing yet (messages it
        # already sent may still be on their way to the callback)
        sent = info.delivered.consumer_seq if info.delivered else 0
        if info.num_pending == 0 and not sent:
            self._loaded.set()
        await self._loaded.wait()

    async def current(self, timeout: float = 5.0) -> None:
        """Return once this copy has every change the bucket had when called (asked of the
        stream's leader): after a server was lost, the watch may be seconds behind while it
        is made again. StateUnavailable if it is not there within ``timeout``."""
        last = (await self.js.stream_info(f"KV_{self.bucket}")).state.last_seq
        deadline = time.monotonic() + timeout
        while self.seq < last:
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), deadline - time.monotonic())
            except TimeoutError:
                raise errors.StateUnavailable(
                    f"this copy of the {self.bucket} bucket is behind ({self.seq} of {last})"
                ) from None

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            self._sub = None

    def get(self, key: str) -> T | None:
        hit = self.items.get(key)
        return hit[0] if hit else None

    def revision(self, key: str) -> int | None:
        hit = self.items.get(key)
        return hit[1] if hit else None


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
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await cls._open(nc, replicas, create)
            except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise errors.Unavailable(
                        f"JetStream did not answer within {wait_s:g} s ({exc!r}); is nats-server "
                        "running with -js, and does its cluster have a quorum?"
                    ) from None
                await asyncio.sleep(0.5)

    @classmethod
    async def _open(cls, nc: NATS, replicas: int, create: bool) -> ClusterState:
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
        return cls(js, kvs)

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

    async def tenant_logins(self) -> dict[str, str]:
        """``{token key: bcrypt hash}`` of every credential that has a NATS login."""
        mirror: Mirror[str] = Mirror(self.js, TENANTS, nats_password)
        await mirror.start()
        await mirror.stop()
        return {key: hashed for key, (hashed, _) in mirror.items.items()}

    async def remove_tenant(self, name: str) -> int:
        """Delete every credential of tenant ``name``; returns how many (NotFound if none)."""
        mirror: Mirror[str] = Mirror(self.js, TENANTS, lambda b: json.loads(b)["tenant"])
        await mirror.start()
        await mirror.stop()
        keys = [key for key, (tenant, _) in mirror.items.items() if tenant == name]
        if not keys:
            raise errors.NotFound(f"no tenant {name!r} (`dsec tenant create {name}` makes one)")
        for key in keys:
            await self.tenants.delete(key)
        return len(keys)

    # -- jobs --------------------------------------------------------------------------------

    async def get_job(self, key: str) -> tuple[JobInfo, int] | None:
        return await _get(self.jobs, key, JobInfo.model_validate_json)

    async def cas_job(self, key: str, info: JobInfo, revision: int | None) -> int:
        """Write ``info`` if the record is still at ``revision`` (None: if there is none)."""
        data = info.model_dump_json().encode()
        try:
            if revision is None:
                return await self.jobs.create(key, data)
            return await self.jobs.update(key, data, revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise errors.Conflict(f"job {key} changed meanwhile") from None

    # -- nodes -------------------------------------------------------------------------------

    async def put_node(self, info: NodeInfo) -> int:
        return await self.nodes.put(info.node, info.model_dump_json().encode())

    async def cas_node(self, info: NodeInfo, revision: int) -> int:
        """Write ``info`` only if the record is still at ``revision`` (else Conflict)."""
        try:
            return await self.nodes.update(info.node, info.model_dump_json().encode(), revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise errors.Conflict(f"node {info.node} changed meanwhile") from None

    # -- sandboxes ---------------------------------------------------------------------------

    async def put_sandboxes(self, infos: list[SandboxInfo]) -> dict[str, int]:
        """Store many records at once (pipelined publishes); returns id -> revision."""
        msgs = [(f"$KV.{SANDBOXES}.{i.id}", i.model_dump_json().encode(), None) for i in infos]
        seqs = await self._publish_all(msgs)
        return {info.id: seq for info, seq in zip(infos, seqs, strict=True)}

    async def _publish_all(
        self, msgs: list[tuple[str, bytes, dict[str, str] | None]], timeout: float = 10.0
    ) -> list[int]:
        """Publish to JetStream pipelined; returns the sequence numbers. Once no ack has come
        for :data:`ACK_SILENCE_S` (a stream's leader was lost with its server, or another is
        being elected), the messages still unacknowledged are published again one by one
        (:func:`publish`) within ``timeout``; StateUnavailable if they still are not taken."""
        if not msgs:
            return []
        until = time.monotonic() + timeout
        futures = [await self.js.publish_async(s, d, headers=h) for s, d, h in msgs]
        waiting = set(futures)
        while waiting:
            done, waiting = await asyncio.wait(waiting, timeout=ACK_SILENCE_S)
            if not done:
                break
        seqs: list[int] = []
        for (subject, data, headers), fut in zip(msgs, futures, strict=True):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                seqs.append(fut.result().seq)
                continue
            fut.cancel()
            left = max(1.0, until - time.monotonic())
            ack = await publish(self.js, subject, data, headers=headers, timeout=left)
            seqs.append(ack.seq)
        return seqs

    async def get_sandbox(self, sandbox_id: str) -> tuple[SandboxInfo, int] | None:
        return await _get(self.sandboxes, sandbox_id, SandboxInfo.model_validate_json)

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
        await self._publish_all([(f"$KV.{SANDBOXES}.{i}", b"", dele) for i in ids])

    async def scan_sandboxes(self, node: str | None = None) -> dict[str, tuple[SandboxInfo, int]]:
        """Every sandbox record (of ``node`` only, when given), read with a one-off watch."""
        mirror: Mirror[SandboxInfo] = Mirror(self.js, SANDBOXES, SandboxInfo.model_validate_json)
        await mirror.start()
        await mirror.stop()
        if node is None:
            return mirror.items
        return {k: v for k, v in mirror.items.items() if v[0].node == node}


async def publish(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    *,
    headers: dict[str, str] | None = None,
    stream: str | None = None,
    timeout: float = 10.0,
) -> api.PubAck:
    """Publish one message to JetStream and wait for its ack; published again while the
    stream has no leader (lost with a server, being elected: 4-9 s) or an ack does not come
    within :data:`ACK_SILENCE_S`, for at most ``timeout``; then StateUnavailable. Every copy
    has one ``Nats-Msg-Id``: JetStream stores one of them (within its duplicate window)."""
    headers = {**(headers or {}), "Nats-Msg-Id": secrets.token_hex(12)}
    until = time.monotonic() + timeout
    while True:
        try:
            wait = min(ACK_SILENCE_S, max(0.5, until - time.monotonic()))
            return await js.publish(subject, data, timeout=wait, stream=stream, headers=headers)
        except (nats.errors.Error, TimeoutError) as exc:
            if time.monotonic() > until:
                raise errors.StateUnavailable(f"JetStream did not take a write: {exc!r}") from None
            await asyncio.sleep(0.25)


async def ensure_replicas(js: JetStreamContext, name: str, replicas: int) -> None:
    """Give the existing stream ``name`` at least ``replicas`` copies: one made with fewer
    (by a single-server run on the same state, say) would be lost with the server holding
    it. Raised in place (JetStream copies it to the new peers) with a warning; if the
    cluster refuses, the warning says how to do it by hand."""
    info = await js.stream_info(name)
    have = info.config.num_replicas or 1
    if have >= replicas:
        return
    try:
        done = await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))
        if (done.config.num_replicas or 1) < replicas:
            raise nats.errors.Error(f"it kept {done.config.num_replicas}")
    except nats.errors.Error as exc:
        log.warning(
            "stream %s has %d replica(s), fewer than the %d configured (DSEC_KV_REPLICAS), and "
            "JetStream would not raise them (%s): run `nats stream edit %s --replicas %d`",
            name, have, replicas, exc, name, replicas,
        )  # fmt: skip
        return
    log.warning("stream %s had %d replica(s), fewer than the %d configured (DSEC_KV_REPLICAS): "
                "raised to %d", name, have, replicas, replicas)  # fmt: skip


async def _get(kv: KeyValue, key: str, parse: Callable[[bytes], T]) -> tuple[T, int] | None:
    """A record and its revision, or None if there is none (or it was deleted)."""
    try:
        entry = await kv.get(key)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    assert entry.value is not None and entry.revision is not None
    return parse(entry.value), entry.revision
