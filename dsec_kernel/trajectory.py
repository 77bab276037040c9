"""Sandbox trajectories: every command run in a sandbox, with its result, in order.

They live in JetStream, one stream per tenant (``dsec-traj-<tenant>``), one subject per
sandbox (``dsec.trajectory.<tenant>.<sandbox id>``), so they outlive the node that ran the
commands (a lost sandbox can be rebuilt from its last snapshot plus the commands after it)
and the sandbox itself (provenance, for the stream's ``max_age``). Edges append, making a
tenant's stream on its first entry; apiservers read. A tenant's stream holds at most its own
share of bytes, its oldest entries going first: one tenant logging a lot forgets its own
history, never another's (in one shared stream, a tenant's 400 commands of 20 MiB each had
erased every tenant's history and the request ids behind exactly-once commands).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.client import JetStreamContext

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import CommandRecord, ExecResult
from dsec_kernel.state.jetstream import ensure_replicas, publish

__all__ = ["READ_BYTES", "Replays", "Trajectory", "stream", "subject"]


#: most bytes of entries one read keeps (the newest)
READ_BYTES = 32 << 20
#: entries pulled at a time (each at most ~1.2 MiB: a command line of 1 MiB, capped output)
FETCH = 16
#: a batch not come by then: its consumer went with a server (the read is asked again)
FETCH_WAIT_S = 5.0
#: most entries kept per sandbox (its oldest go first)
PER_SANDBOX = 10_000
#: seconds a read of a sandbox's log serves the request ids looked up in it
LOG_CACHE_S = 10.0


def stream(tenant: str) -> str:
    return f"dsec-traj-{tenant}"


def subject(tenant: str, sandbox_id: str) -> str:
    return f"dsec.trajectory.{tenant}.{sandbox_id}"


class Trajectory:
    """Appends to and reads the tenants' trajectory streams (made with ``replicas`` copies,
    at most ``max_mb`` each, entries kept ``max_age_s``)."""

    def __init__(
        self,
        js: JetStreamContext,
        replicas: int = 1,
        max_mb: int = 1024,
        max_age_s: float = 86400.0,
    ) -> None:
        self.js = js
        self.config = dict(replicas=replicas, max_bytes=max_mb << 20, max_age=max_age_s)
        self._made: set[str] = set()

    async def _ensure(self, tenant: str) -> None:
        if tenant in self._made:
            return
        config = api.StreamConfig(
            name=stream(tenant),
            subjects=[f"dsec.trajectory.{tenant}.>"],
            storage=api.StorageType.FILE,
            num_replicas=self.config["replicas"],
            max_age=self.config["max_age"],
            max_bytes=self.config["max_bytes"],
            max_msgs_per_subject=PER_SANDBOX,
            discard=api.DiscardPolicy.OLD,
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:  # made meanwhile, or before
            await ensure_replicas(self.js, config.name, self.config["replicas"])
        self._made.add(tenant)

    async def append(self, tenant: str, sandbox_id: str, record: CommandRecord) -> int:
        """Store one entry (acknowledged by JetStream, waiting out an election); returns its
        sequence number."""
        await self._ensure(tenant)
        data = record.model_dump_json(exclude={"seq"}).encode()
        ack = await publish(self.js, subject(tenant, sandbox_id), data, stream=stream(tenant))
        return ack.seq

    async def read(
        self, tenant: str, sandbox_id: str, max_bytes: int = READ_BYTES
    ) -> list[CommandRecord]:
        """The newest entries still kept, oldest first, ``seq`` set: as many as fit in
        ``max_bytes`` (what one reply can carry). Pulled in batches of :data:`FETCH`, so the
        connection never holds more than a batch (a push consumer once delivered a whole
        150 MiB log at once, and NATS dropped the service's connection as a slow consumer)."""
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=60.0,
        )  # fmt: skip
        try:
            sub = await self.js.pull_subscribe(
                subject(tenant, sandbox_id), stream=stream(tenant), config=config
            )
        except nats.js.errors.NotFoundError:  # nothing logged for the tenant yet
            return []
        try:
            if (await sub.consumer_info()).num_pending == 0:
                return []
            out: deque[tuple[int, CommandRecord]] = deque()
            held = 0
            while True:
                try:
                    msgs = await sub.fetch(batch=FETCH, timeout=FETCH_WAIT_S)
                except nats.errors.TimeoutError:  # entries left but none came: never a part
                    raise errors.StateUnavailable(  # of a trajectory as if it were all of it
                        f"the trajectory stream of {tenant} did not deliver"
                    ) from None
                for msg in msgs:
                    rec = CommandRecord.model_validate_json(msg.data)
                    rec.seq = msg.metadata.sequence.stream
                    out.append((len(msg.data), rec))
                    held += len(msg.data)
                    while held > max_bytes and out:
                        held -= out.popleft()[0]
                if not msgs or msgs[-1].metadata.num_pending == 0:
                    break
            return [rec for _, rec in out]
        finally:
            await sub.unsubscribe()


class Replays:
    """Exactly-once commands: which request ids each sandbox ran, the futures of those still
    running, and the results of the last few. A request id seen before gets its first run's
    result (waiting for it if it is still running) instead of running again.

    Results not kept in memory (older ones, or from before an edge restart) are read back
    from the trajectory, output capped as it was logged: one read at a time per sandbox,
    shared by every request that needs it and kept for :data:`LOG_CACHE_S` (twenty resends
    of an old id at once were twenty reads of the whole log).
    """

    def __init__(self, trajectory: Trajectory, keep: int = 8) -> None:
        self.trajectory = trajectory
        self.keep = keep
        self._ids: dict[str, set[str]] = {}
        self._results: dict[str, dict[str, asyncio.Future[ExecResult]]] = {}
        self._logs: dict[str, tuple[float, asyncio.Future[dict[str, CommandRecord]]]] = {}

    async def lookup(
        self, tenant: str, sandbox_id: str, request_id: str
    ) -> asyncio.Future[ExecResult] | None:
        """The run of ``request_id`` in the sandbox, or None if it never ran there."""
        ids = self._ids.get(sandbox_id)
        if ids is None:  # first request since this edge started: learn what ran before
            logged = await self._logged(tenant, sandbox_id)
            ids = self._ids.setdefault(sandbox_id, set())
            ids.update(logged)
        if request_id not in ids:
            return None
        fut = self._results.get(sandbox_id, {}).get(request_id)
        if fut is not None:
            return fut
        rec = (await self._logged(tenant, sandbox_id)).get(request_id)
        if rec is None:  # ran after the read that is kept: read again
            rec = (await self._logged(tenant, sandbox_id, fresh=True)).get(request_id)
        if rec is None:
            return None
        done: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        done.set_result(_result(sandbox_id, rec))
        return done

    async def _logged(
        self, tenant: str, sandbox_id: str, fresh: bool = False
    ) -> dict[str, CommandRecord]:
        """request id -> its first entry in the sandbox's log (see the class docstring);
        ``fresh``: read again unless a read is under way."""
        hit = self._logs.get(sandbox_id)
        stale = (
            hit is not None and hit[1].done() and (fresh or time.monotonic() - hit[0] > LOG_CACHE_S)
        )
        if hit is None or stale:
            read = asyncio.ensure_future(self.trajectory.read(tenant, sandbox_id))
            hit = self._logs[sandbox_id] = (time.monotonic(), asyncio.ensure_future(_by_id(read)))
        try:
            return await asyncio.shield(hit[1])
        except Exception:
            if self._logs.get(sandbox_id) is hit:
                del self._logs[sandbox_id]  # not kept: the next request reads again
            raise

    def fresh(self, sandbox_id: str) -> None:
        """A sandbox made by this edge: nothing ran in it before, no log to read back."""
        self._ids.setdefault(sandbox_id, set())

    def begin(self, sandbox_id: str, request_id: str) -> asyncio.Future[ExecResult]:
        """Mark ``request_id`` as running in the sandbox (call right after :meth:`lookup`)."""
        fut: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self._ids.setdefault(sandbox_id, set()).add(request_id)
        results = self._results.setdefault(sandbox_id, {})
        results[request_id] = fut
        finished = [k for k, f in results.items() if f.done()]  # oldest first
        for old in finished[: max(0, len(finished) - self.keep)]:
            del results[old]
        return fut

    def end(self, sandbox_id: str, request_id: str, result: ExecResult, ran: bool) -> None:
        """The run finished with ``result``; if the command did not run (``ran`` False, e.g.
        the sandbox was paused) the id is forgotten, so sending it again runs it."""
        fut = self._results.get(sandbox_id, {}).get(request_id)
        if fut is not None and not fut.done():
            fut.set_result(result)
        if not ran:
            self._ids.get(sandbox_id, set()).discard(request_id)
            self._results.get(sandbox_id, {}).pop(request_id, None)

    def forget(self, sandbox_id: str) -> None:
        self._ids.pop(sandbox_id, None)
        self._results.pop(sandbox_id, None)
        self._logs.pop(sandbox_id, None)


async def _by_id(read: Awaitable[list[CommandRecord]]) -> dict[str, CommandRecord]:
    out: dict[str, CommandRecord] = {}
    for rec in await read:
        if rec.request_id:
            out.setdefault(rec.request_id, rec)
    return out


def _result(sandbox_id: str, rec: CommandRecord) -> ExecResult:
    return ExecResult(
        sandbox_id=sandbox_id, stdout=rec.stdout, stderr=rec.stderr, exit_code=rec.exit_code,
        duration_s=rec.duration_s, timed_out=rec.timed_out,
        truncated=rec.truncated or len(rec.stdout) < rec.stdout_bytes
        or len(rec.stderr) < rec.stderr_bytes,
    )  # fmt: skip
