"""Handles on one sandbox and on one snapshot, and the narrow interface a sandbox handle asks
of its client (:class:`~dsec_kernel.sdk.client.AsyncClient` provides it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import (
    DEFAULT_MAX_OUTPUT,
    CommandRecord,
    ExecResult,
    FsDiff,
    FsDiffRequest,
    Message,
    PauseReport,
    ReadFileRequest,
    ReadFileResponse,
    RestoreRequest,
    SandboxInfo,
    SnapshotInfo,
    SnapshotRequest,
    StatusRequest,
    WriteFileRequest,
    WriteFileResponse,
)
from dsec_kernel.sdk.arguments import build_request
from dsec_kernel.sdk.results import DestroyReport, NotCreated, check_one

__all__ = ["Sandbox", "SandboxClient", "Snapshot"]

M = TypeVar("M", bound=BaseModel)


class SandboxClient(Protocol):
    """What a sandbox handle asks of the client it came from: requests, and the batch calls
    its own methods are one-sandbox cases of."""

    async def _call(
        self, op: str, msg: Message, reply: type[M], timeout: float | None = None
    ) -> M: ...

    async def exec_many(
        self, sandboxes: Sequence[Sandbox | str], *args: Any, **kwargs: Any
    ) -> list[ExecResult]: ...

    async def destroy(
        self, sandboxes: Sandbox | str | Iterable[Sandbox | str | NotCreated]
    ) -> list[DestroyReport]: ...

    async def pause(self, sandboxes: Iterable[Sandbox | str]) -> list[PauseReport]: ...

    async def resume(self, sandboxes: Iterable[Sandbox | str]) -> list[PauseReport]: ...

    async def trajectory(self, sandbox_id: str) -> list[CommandRecord]: ...


class Snapshot:
    """A sandbox's files at one moment (see :meth:`Sandbox.snapshot`)."""

    def __init__(self, info: SnapshotInfo) -> None:
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def sandbox_id(self) -> str:
        return self.info.sandbox_id

    @property
    def parent(self) -> str | None:
        return self.info.parent

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.sandbox_id} depth {self.info.depth}>"


class Sandbox:
    """A handle on one sandbox. ``async with`` destroys it on exit."""

    #: always None: as an entry of ``create``'s answer, a sandbox that was made (see
    #: :mod:`dsec_kernel.sdk.results`)
    error: errors.DsecError | None = None

    def __init__(self, client: SandboxClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def backend(self) -> str:
        return self.info.backend

    @property
    def node(self) -> str:
        return self.info.node

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.backend}@{self.node} {self.info.state}>"

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str = b"",
        user: str | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT,
        request_id: str | None = None,
    ) -> ExecResult:
        """Run ``command`` (argv list, or a string for ``/bin/sh -c``) and wait for it.

        A command still running at ``timeout`` seconds is killed with everything it started
        and comes back with ``timed_out=True``; output past ``max_output_bytes`` per stream
        is dropped and ``truncated=True``. Raises a DsecError if it could not run at all.

        Each call carries a request id (``request_id``, or a fresh one): if no answer comes
        in time (lost in a reconnect), the call is sent once more with the same id and gets
        the first run's result, waiting for it if it still runs — never a second run.
        """
        (result,) = await self._client.exec_many(
            [self],
            command,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=stdin,
            user=user,
            max_output_bytes=max_output_bytes,
            request_id=request_id,
        )
        return check_one(result)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> int:
        """Create or replace the file at ``path``; returns its size."""
        payload = data.encode() if isinstance(data, str) else data
        req = build_request(
            WriteFileRequest, sandbox_id=self.id, path=path, data=payload, mode=mode
        )
        resp = await self._client._call("file.write", req, WriteFileResponse)
        return resp.size

    async def read_file(self, path: str) -> bytes:
        """The content of the file at ``path`` (NotFound if there is none)."""
        req = build_request(ReadFileRequest, sandbox_id=self.id, path=path)
        return (await self._client._call("file.read", req, ReadFileResponse)).data

    async def status(self) -> SandboxInfo:
        """The sandbox's current record (``state``: ``ready``, ``paused`` or ``lost``)."""
        self.info = await self._client._call(
            "status", build_request(StatusRequest, id=self.id), SandboxInfo
        )
        return self.info

    async def destroy(self) -> None:
        """Destroy the sandbox. Idempotent."""
        check_one((await self._client.destroy([self]))[0])

    async def pause(self) -> PauseReport:
        """Freeze every process and reclaim the sandbox's memory; files and processes stay.
        Commands sent meanwhile raise SandboxPaused until :meth:`resume`. Idempotent."""
        return check_one((await self._client.pause([self]))[0])

    async def resume(self) -> PauseReport:
        """Carry on from where :meth:`pause` stopped. Idempotent."""
        return check_one((await self._client.resume([self]))[0])

    async def snapshot(self, *, keep: bool = False) -> Snapshot:
        """Record the sandbox's files now (incrementally; processes keep running).

        A snapshot lives while anything uses it (this sandbox, sandboxes restored or forked
        from it, later snapshots built on it), or for good with ``keep``.
        """
        req = build_request(SnapshotRequest, sandbox_id=self.id, keep=keep)
        return Snapshot(await self._client._call("snapshot", req, SnapshotInfo))

    async def restore(self, snapshot: Snapshot | str | None) -> None:
        """Put the sandbox back exactly as at ``snapshot``: its files, and no process started
        after it. ``None`` restores the state it was created in (see :meth:`reset`)."""
        sid = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        req = build_request(RestoreRequest, sandbox_id=self.id, snapshot_id=sid)
        self.info = await self._client._call("restore", req, SandboxInfo)

    async def reset(self) -> None:
        """Back to the clean state the sandbox was created in (for reuse from a pool)."""
        await self.restore(None)

    async def fs_diff(self, since: Snapshot | str | None = None) -> FsDiff:
        """Paths added, modified and deleted since creation, or since ``since``."""
        sid = since.id if isinstance(since, Snapshot) else since
        req = build_request(FsDiffRequest, sandbox_id=self.id, since=sid)
        return await self._client._call("fs_diff", req, FsDiff)

    async def trajectory(self) -> list[CommandRecord]:
        """The sandbox's ordered log: every command with its result (output capped), and
        every snapshot and restore. Kept outside the node, so also readable once the
        sandbox is lost (see :meth:`AsyncClient.recover`) or destroyed (for a day)."""
        return await self._client.trajectory(self.id)

    async def commands(self) -> list[CommandRecord]:
        """The commands of :meth:`trajectory` only."""
        return [r for r in await self.trajectory() if r.kind == "exec"]

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()
