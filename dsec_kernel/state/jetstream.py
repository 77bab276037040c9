"""Writing to JetStream through leader elections, and a stream's replicas.

A stream whose leader was lost with its server takes 4-9 s to elect another; writes made
meanwhile are published again until it answers, each copy with one ``Nats-Msg-Id`` so
that JetStream stores one of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import nats.errors
from nats.js import api
from nats.js.client import JetStreamContext

from dsec_kernel.contract import errors

__all__ = ["ACK_SILENCE_S", "ensure_replicas", "publish", "publish_all"]

log = logging.getLogger(__name__)

ACK_SILENCE_S = 2.0  # no JetStream ack for this long: the message is sent again


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


async def publish_all(
    js: JetStreamContext,
    msgs: list[tuple[str, bytes, dict[str, str] | None]],
    timeout: float = 10.0,
) -> list[int]:
    """Publish to JetStream pipelined; returns the sequence numbers. Once no ack has come
    for :data:`ACK_SILENCE_S` (a stream's leader was lost with its server, or another is
    being elected), the messages still unacknowledged are published again one by one
    (:func:`publish`) within ``timeout``; StateUnavailable if they still are not taken."""
    if not msgs:
        return []
    until = time.monotonic() + timeout
    futures = [await js.publish_async(s, d, headers=h) for s, d, h in msgs]
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
        ack = await publish(js, subject, data, headers=headers, timeout=left)
        seqs.append(ack.seq)
    return seqs


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
