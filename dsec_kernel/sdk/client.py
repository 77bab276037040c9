"""The asynchronous SDK's client: :class:`AsyncClient` (the handles it gives are in
:mod:`.sandbox`, :mod:`.job` and :mod:`.pool`)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from nats.aio.client import Client as NATS
from pydantic import BaseModel

from dsec_kernel import bus
from dsec_kernel.connection import resolve
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    DEFAULT_MAX_OUTPUT,
    MAX_BATCH,
    CommandRecord,
    CreateRequest,
    CreateResponse,
    DestroyRequest,
    DestroyResponse,
    Env,
    ExecRequest,
    ExecResponse,
    ExecResult,
    FncallRequest,
    HistoryRequest,
    HistoryResponse,
    JobRenewRequest,
    LayerInfo,
    LayerRef,
    Limits,
    ListRequest,
    ListResponse,
    Message,
    NodeInfo,
    NodesRequest,
    NodesResponse,
    PauseReport,
    PauseRequest,
    PauseResponse,
    PoolInfo,
    PoolOpenRequest,
    PrestageRequest,
    PrestageResponse,
    PublishRequest,
    ResumeRequest,
    SandboxInfo,
    SandboxSpec,
    StatusRequest,
)
from dsec_kernel.sdk.arguments import build_request
from dsec_kernel.sdk.job import Job
from dsec_kernel.sdk.pool import Pool
from dsec_kernel.sdk.results import DestroyReport, NotCreated, check_one
from dsec_kernel.sdk.sandbox import Sandbox, Snapshot

__all__ = ["AsyncClient"]

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
R = TypeVar("R")
#: how long a request is sent again while nothing serves the API (an apiserver restarting)
NO_RESPONDERS_WAIT_S = 1.0
#: seconds the client waits beyond a command's own timeout
_MARGIN_S = 30.0
Progress = Callable[[int, int], object]


def _ids(sandboxes: Iterable[Sandbox | str]) -> list[str]:
    """The ids of handles or ids; anything else (an entry of a create that failed) is
    refused, naming its place."""
    ids: list[str] = []
    for i, s in enumerate(sandboxes):
        if isinstance(s, Sandbox):
            ids.append(s.id)
        elif isinstance(s, str):
            ids.append(s)
        else:
            raise errors.InvalidArgument(
                f"sandboxes[{i}]: expected a sandbox or its id, not {s!r}; keep only the "
                "entries of create whose error is None"
            )
    return ids


def _parts(ids: list[str]) -> list[list[str]]:
    """``ids`` a request's worth at a time (at most :data:`MAX_BATCH`)."""
    return [ids[i : i + MAX_BATCH] for i in range(0, len(ids), MAX_BATCH)]


async def _each(reqs: Sequence[T], send: Callable[[T], Awaitable[R]]) -> list[R | errors.DsecError]:
    """``send(req)`` for every request at once: each one's answer, or the DsecError it
    raised — raised instead if every request raised one (the call as a whole failed)."""
    outs = await asyncio.gather(*(send(r) for r in reqs), return_exceptions=True)
    for out in outs:
        if isinstance(out, BaseException) and not isinstance(out, errors.DsecError):
            raise out
    if outs and all(isinstance(out, errors.DsecError) for out in outs):
        raise outs[0]
    return outs  # type: ignore[return-value]


def replay_plan(log: list[CommandRecord]) -> tuple[str | None, list[CommandRecord]]:
    """(snapshot to start from, commands to run after it) that rebuild the state a
    trajectory ends in: the last snapshot or restore, and the commands logged after it."""
    base: str | None = None
    todo: list[CommandRecord] = []
    for rec in log:
        if rec.kind == "exec":
            todo.append(rec)
        else:
            base, todo = rec.snapshot_id, []
    return base, todo


class AsyncClient:
    """The DSec client. Connects to the address and credential that :func:`resolve` finds,
    logging in to NATS as the credential's own user (:meth:`bus.Login.for_token`): it hears
    replies in its own inbox only.

    ``async with AsyncClient() as c:`` connects and closes (Unauthenticated if NATS does not
    know the token). Batch calls (``create`` with a count, ``exec_many``, ``pause``,
    ``resume``, ``destroy``) answer one entry per sandbox, each with its own ``error``
    (:mod:`dsec_kernel.sdk.results`); they and every other method raise a
    :class:`~dsec_kernel.contract.errors.DsecError` subclass when the request as a whole fails.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        name: str = "dsec-sdk",
    ) -> None:
        self._url, self._token = url, token
        self.timeout = timeout
        self._name = name
        self._nc: NATS | None = None
        self._headers: dict[str, str] = {}

    async def connect(self) -> AsyncClient:
        conn = resolve(self._url, self._token)
        self._headers = {bus.TOKEN_HEADER: conn.token}
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._back = asyncio.Event()
        self._nc = await bus.connect(
            conn.url,
            name=self._name,
            login=bus.Login.for_token(conn.token),
            disconnected_cb=self._on_lost,
            reconnected_cb=self._on_back,
        )
        return self

    async def _on_lost(self) -> None:
        self._back.clear()
        if not self._lost.done():
            self._lost.set_result(None)  # every request waiting now learns of it

    async def _on_back(self) -> None:
        self._lost = asyncio.get_running_loop().create_future()  # for the requests to come
        self._back.set()

    async def close(self) -> None:
        if self._nc is not None:
            await bus.disconnect(self._nc)
            self._nc = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, op: str, msg: Message, reply: type[M], timeout: float | None = None) -> M:
        """Send a request; if the connection to NATS drops meanwhile (the request or its
        answer may be lost with it), send it again once reconnected. Every request is safe to
        repeat: reads, idempotent changes, and creates and commands by their request id.
        While nothing serves the API (an apiserver restarting) it is sent again for up to
        :data:`NO_RESPONDERS_WAIT_S`."""
        if self._nc is None:
            raise errors.Unavailable("the client is not connected; use `async with` or connect()")
        patience = time.monotonic() + NO_RESPONDERS_WAIT_S
        reconnects = 0
        while reconnects < 3:
            if self._nc.is_closed:  # not by close(): NATS refused the login when reconnecting
                raise errors.Unauthenticated(
                    f"NATS closed the connection before {op}: it no longer knows this credential "
                    "(removed by the operator?)"
                )
            send = bus.request(
                self._nc, bus.api_subject(op), msg, reply,
                timeout=timeout or self.timeout, headers=self._headers,
            )  # fmt: skip
            call = asyncio.ensure_future(send)
            await asyncio.wait({call, self._lost}, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                if isinstance(call.exception(), bus.NoResponders) and time.monotonic() < patience:
                    await asyncio.sleep(0.05)
                    continue
                return call.result()
            call.cancel()
            reconnects += 1
            try:
                await asyncio.wait_for(self._back.wait(), timeout or self.timeout)
            except TimeoutError:
                break
        raise errors.Unavailable(f"lost the connection to NATS during {op}; it did not come back")

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(
        self,
        count: int = 1,
        *,
        backend: str | None = None,
        env: Env | None = None,
        ttl: float | None = None,
        idle_ttl: float | None = None,
        limits: Limits | None = None,
        labels: dict[str, str] | None = None,
        network: str = "none",
        from_snapshot: Snapshot | None = None,
        progress: Progress | None = None,
        batch_size: int = 500,
        concurrency: int = 4,
        job: str | None = None,
        wait: float = 30.0,
    ) -> list[Sandbox | NotCreated]:
        """Create ``count`` sandboxes alike, in batches of ``batch_size`` (one request each).

        ``backend`` defaults to the snapshot's with ``from_snapshot`` (a fork: each starts with
        the snapshot's files), else the cluster's default. ``env`` names the layers to compose
        (container and VM backends); ``network`` is ``none`` or ``egress``. ``ttl``: seconds
        until the platform destroys them; ``idle_ttl``: seconds without a command until it
        pauses one (the next command resumes it). ``progress(done, total)`` is called as
        batches complete. ``job``: the job they belong to (see :meth:`job`).

        Returns ``count`` entries: the sandboxes made, then a :class:`NotCreated` (with its
        ``error``) for each that could not be — past your quota (QuotaExceeded), in a batch
        that found no room in time (CapacityExceeded, retryable) or whose queue was full
        (QueueFull), refused by its node... Nothing of those is left behind. Raises only if
        none could be made (then nothing was). For all or none, destroy the made ones when
        any entry has an error. When the cluster is full, each batch waits in the admission
        queue for up to ``wait`` seconds (higher-priority jobs first).
        """
        if count < 1:
            raise errors.InvalidArgument(f"count must be at least 1, not {count}")
        if backend is None and from_snapshot is not None:
            backend = from_snapshot.info.backend
        spec = build_request(
            SandboxSpec,
            backend=backend,
            ttl_s=ttl,
            idle_ttl_s=idle_ttl,
            job=job,
            limits=limits or Limits(),
            labels=labels or {},
            env=env,
            network=network,
            snapshot=from_snapshot.id if from_snapshot else None,
        )
        size = max(1, min(batch_size, MAX_BATCH))
        batches = [min(size, count - i) for i in range(0, count, size)]
        slots = asyncio.Semaphore(concurrency)
        done = 0

        async def one(n: int) -> CreateResponse:
            nonlocal done
            req = build_request(
                CreateRequest, spec=spec, count=n, wait_s=wait, partial=True,
                request_id=uuid.uuid4().hex,
            )  # fmt: skip
            try:
                async with slots:
                    return await self._call("create", req, CreateResponse, self.timeout * 2 + wait)
            finally:
                done += n
                if progress is not None:
                    progress(done, count)

        made: list[Sandbox | NotCreated] = []
        missing: list[Sandbox | NotCreated] = []
        for n, out in zip(batches, await _each(batches, one), strict=True):
            if isinstance(out, errors.DsecError):
                missing += [NotCreated(error=out) for _ in range(n)]
                continue
            made += [Sandbox(self, info) for info in out.sandboxes]
            missing += [NotCreated(error=f.error) for f in out.failed for _ in range(f.count)]
        return made + missing

    async def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox of yours (NotFound otherwise)."""
        info = await self._call("status", build_request(StatusRequest, id=sandbox_id), SandboxInfo)
        return Sandbox(self, info)

    async def list(self, labels: dict[str, str] | None = None) -> list[Sandbox]:
        """Your sandboxes (those carrying all of ``labels``, when given), by id."""
        out: list[Sandbox] = []
        after: str | None = None
        while True:
            req = build_request(ListRequest, labels=labels or {}, after=after)
            resp = await self._call("list", req, ListResponse)
            out += [Sandbox(self, info) for info in resp.sandboxes]
            if resp.next is None:
                return out
            after = resp.next

    async def destroy(
        self, sandboxes: Sandbox | str | Iterable[Sandbox | str | NotCreated]
    ) -> list[DestroyReport]:
        """Destroy sandboxes (handles or ids). Idempotent: one :class:`DestroyReport` per
        sandbox, in order — destroyed, not found (nothing to do), or its ``error`` (still
        there: destroy it again). ``create``'s entries may be given as they came: one it
        could not make has nothing to destroy (``found`` False, no id)."""
        items = [sandboxes] if isinstance(sandboxes, Sandbox | str) else list(sandboxes)
        made = [s for s in items if not isinstance(s, NotCreated)]
        reqs = [build_request(DestroyRequest, ids=part) for part in _parts(_ids(made))]

        async def send(req: DestroyRequest) -> DestroyResponse:
            return await self._call("destroy", req, DestroyResponse)

        reports: list[DestroyReport] = []
        for req, out in zip(reqs, await _each(reqs, send), strict=True):
            if isinstance(out, errors.DsecError):
                reports += [DestroyReport(sandbox_id=i, error=out) for i in req.ids]
                continue
            gone, failed = set(out.not_found), {f.id: f.error for f in out.failed}
            reports += [
                DestroyReport(sandbox_id=i, found=i not in gone, error=failed.get(i))
                for i in req.ids
            ]
        done = iter(reports)
        return [
            DestroyReport(sandbox_id="", found=False) if isinstance(s, NotCreated) else next(done)
            for s in items
        ]

    async def pause(self, sandboxes: Iterable[Sandbox | str]) -> list[PauseReport]:
        """Pause many sandboxes (see :meth:`Sandbox.pause`): one report per sandbox, in
        order, each what was done or its ``error``."""
        return await self._power("pause", PauseRequest, sandboxes)

    async def resume(self, sandboxes: Iterable[Sandbox | str]) -> list[PauseReport]:
        """Resume many sandboxes (see :meth:`Sandbox.resume`): one report per sandbox, in
        order, each what was done or its ``error``."""
        return await self._power("resume", ResumeRequest, sandboxes)

    async def _power(
        self, op: str, model: type[PauseRequest | ResumeRequest], sandboxes: Iterable[Sandbox | str]
    ) -> list[PauseReport]:
        reqs = [build_request(model, ids=part) for part in _parts(_ids(sandboxes))]

        async def send(req: PauseRequest | ResumeRequest) -> PauseResponse:
            return await self._call(op, req, PauseResponse)

        reports: list[PauseReport] = []
        for req, out in zip(reqs, await _each(reqs, send), strict=True):
            if isinstance(out, errors.DsecError):
                reports += [PauseReport(sandbox_id=i, error=out) for i in req.ids]
                continue
            by_id = {r.sandbox_id: r for r in out.done}
            by_id |= {f.id: PauseReport(sandbox_id=f.id, error=f.error) for f in out.failed}
            reports += [by_id[i] for i in req.ids]
        return reports

    async def trajectory(self, sandbox_id: str) -> list[CommandRecord]:
        """A sandbox's trajectory by id (see :meth:`Sandbox.trajectory`); JSON lines of it:
        ``"\\n".join(r.model_dump_json() for r in records)``."""
        req = build_request(HistoryRequest, sandbox_id=sandbox_id)
        return (await self._call("history", req, HistoryResponse)).commands

    async def recover(self, sandbox: Sandbox | str) -> Sandbox:
        """Rebuild a lost sandbox: a new one from its last snapshot (or its clean state),
        then every command logged after that, replayed in order. The lost record goes.

        Commands that depend on the outside world or on time may come out differently;
        compare ``(await new.commands())`` with the old trajectory if that matters.
        """
        sid = sandbox.id if isinstance(sandbox, Sandbox) else sandbox
        info = await self._call("status", build_request(StatusRequest, id=sid), SandboxInfo)
        if info.state != "lost":
            raise errors.Conflict(f"sandbox {sid} is {info.state}, not lost: nothing to recover")
        if info.spec is None:
            raise errors.Unsupported(f"sandbox {sid} was made by an older DSec: no spec kept")
        base, todo = replay_plan(await self.trajectory(sid))
        spec = info.spec.model_copy(update={"snapshot": base or info.spec.snapshot})
        resp = await self._call("create", CreateRequest(spec=spec), CreateResponse)
        new = Sandbox(self, resp.sandboxes[0])
        try:
            for rec in todo:
                await new.exec(
                    rec.argv, timeout=rec.timeout_s or 60.0, env=rec.env, cwd=rec.cwd,
                    stdin=rec.stdin, user=rec.user,
                )  # fmt: skip
        except BaseException:
            await self.destroy([new])
            raise
        await self.destroy([sid])
        return new

    async def pool(
        self,
        *,
        size: int,
        backend: str | None = None,
        env: Env | None = None,
        max_size: int | None = None,
        name: str | None = None,
        limits: Limits | None = None,
        labels: dict[str, str] | None = None,
        network: str = "none",
        idle_ttl: float | None = None,
    ) -> Pool:
        """A warm pool of ``size`` ready sandboxes of this spec, filled in the background
        and grown by demand up to ``max_size`` (default 4 x size), on ``backend`` (None: the
        cluster's default). ``name`` defaults to one derived from the spec, so the same spec
        finds the same pool again."""
        spec = build_request(
            SandboxSpec, backend=backend, env=env, limits=limits or Limits(),
            labels=labels or {}, network=network, idle_ttl_s=idle_ttl,
        )  # fmt: skip
        if name is None:
            digest = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:12]
            name = f"{backend or 'default'}-{digest}"
        req = build_request(PoolOpenRequest, name=name, spec=spec, size=size, max_size=max_size)
        return Pool(self, await self._call("pool.open", req, PoolInfo))

    def job(self, name: str, *, priority: int = 0, lease_s: float = 30.0) -> Job:
        """A job holding a trainer's lease on its sandboxes; use it as ``async with``.

        Sandboxes made with ``job.create(...)`` are paused when the lease lapses (no renewal
        for ``lease_s``) and resumed when it is renewed; they go when the job ends.
        ``priority`` (0-100): under pressure, lower-priority jobs' sandboxes are paused first.
        """
        req = build_request(JobRenewRequest, name=name, priority=priority, lease_s=lease_s)
        return Job(self, req)

    async def prestage(
        self, layers: Sequence[LayerRef | str], *, pool: str | None = None
    ) -> PrestageResponse:
        """Have the nodes of ``pool`` (all, if None) mount these layers (``LayerRef`` s, or
        ``name:version``) and read their metadata now — before a burst sends sandboxes
        there. Placement then prefers them for sandboxes on those layers."""
        req = build_request(PrestageRequest, layers=list(layers), pool=pool)
        return await self._call("prestage", req, PrestageResponse, self.timeout * 4)

    async def publish(
        self, snapshot: Snapshot | str, *, kind: str, name: str, version: str
    ) -> LayerInfo:
        """Make a snapshot a layer (``name:version`` of ``kind``) for later sandboxes' ``env``:
        a workspace or toolkit holds everything above the sandbox's base; a base, everything."""
        sid = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        req = build_request(PublishRequest, snapshot_id=sid, kind=kind, name=name, version=version)
        return await self._call("publish", req, LayerInfo, self.timeout * 10)

    async def nodes(self) -> list[NodeInfo]:
        """Every node the cluster knows, with its backends and last heartbeat."""
        return (await self._call("nodes", NodesRequest(), NodesResponse)).nodes

    # -- work --------------------------------------------------------------------------------

    async def exec_many(
        self,
        sandboxes: Sequence[Sandbox | str],
        command: str | Sequence[str],
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str = b"",
        user: str | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT,
        request_id: str | None = None,
    ) -> list[ExecResult]:
        """Run one command in many sandboxes at once (one request per 1,000 sandboxes).

        One result per sandbox, in the order of ``sandboxes`` (handles or ids): the
        command's, or with ``error`` set (and the rest empty) why it could not run there —
        the sandbox lost, destroyed, paused... (:mod:`dsec_kernel.sdk.results`; ``check``
        raises the first). ``request_id``: see :meth:`Sandbox.exec`.
        """
        base = dict(
            request_id=request_id or uuid.uuid4().hex,
            command=command if isinstance(command, str) else list(command),
            timeout_s=timeout,
            env=env or {},
            cwd=cwd,
            user=user,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            max_output_bytes=max_output_bytes,
        )
        parts = _parts(_ids(sandboxes))
        reqs = [build_request(ExecRequest, sandbox_ids=part, **base) for part in parts]

        async def send(req: ExecRequest) -> ExecResponse:
            try:
                return await self._call("exec", req, ExecResponse, timeout + _MARGIN_S)
            except errors.DeadlineExceeded:  # no answer in time: it may have been lost
                return await self._call("exec", req, ExecResponse, timeout + _MARGIN_S)

        results: list[ExecResult] = []
        for req, out in zip(reqs, await _each(reqs, send), strict=True):
            if isinstance(out, errors.DsecError):
                ids = req.sandbox_ids
                results += [ExecResult(sandbox_id=i, exit_code=-1, error=out) for i in ids]
            else:
                results += out.results
        return results

    async def fncall(
        self,
        code: str,
        *,
        language: str = "python",
        timeout: float = 30.0,
        stdin: bytes | str = b"",
        env: dict[str, str] | None = None,
        limits: Limits | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT,
        sandbox: Sandbox | None = None,
    ) -> ExecResult:
        """Run ``code`` once in a fresh, throw-away sandbox (``language``: python, bash...).

        With ``sandbox`` (an fncall sandbox) the call also sees that sandbox's files.
        """
        req = build_request(
            FncallRequest,
            code=code,
            language=language,
            timeout_s=timeout,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            env=env or {},
            limits=limits or Limits(),
            max_output_bytes=max_output_bytes,
            sandbox_id=sandbox.id if sandbox else None,
        )
        return check_one(await self._call("fncall", req, ExecResult, timeout + _MARGIN_S))
