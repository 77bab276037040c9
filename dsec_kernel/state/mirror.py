"""An in-memory copy of a KV bucket, kept current by a watch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.client import JetStreamContext

from dsec_kernel.contract import errors

__all__ = ["MIRROR_HEARTBEAT_S", "Mirror"]

log = logging.getLogger(__name__)

# A mirror's watch is recreated after two heartbeats missed: a stream whose leader was lost
# (its consumer with it) is followed again within seconds of the next leader's election,
# not after nats-py's default 2 x 5 s (each attempt during the election fails and waits
# another round).
MIRROR_HEARTBEAT_S = 1.0
T = TypeVar("T")


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
