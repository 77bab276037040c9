"""The edge's client for the agent protocol: one client for every kind of sandbox."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import grpc

from dsec_kernel import deadline
from dsec_kernel.contract import errors
from dsec_kernel.contract.agent import agent_pb2 as pb
from dsec_kernel.contract.agent.agent_pb2_grpc import AgentStub
from dsec_kernel.contract.wire import ExecResult

__all__ = ["AgentClient", "collect_exec", "status_error", "unix_target"]

#: sockaddr_un holds 108 bytes: longer socket paths are reached through a directory fd
_UNIX_PATH_MAX = 100


def unix_target(path: str) -> tuple[str, int | None]:
    """A gRPC target for the unix socket at ``path``, and the directory fd it needs kept open
    (None when the path is short enough to use as it is)."""
    if len(path) <= _UNIX_PATH_MAX:
        return f"unix://{path}", None
    directory, _, name = path.rpartition("/")
    fd = os.open(directory or "/", os.O_PATH | os.O_DIRECTORY)
    return f"unix:///proc/self/fd/{fd}/{name}", fd


#: trailing metadata naming the DSec error an agent means, where no gRPC status says it
ERROR_CODE_KEY = "dsec-error-code"
_STATUS_ERRORS: dict[grpc.StatusCode, type[errors.DsecError]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: errors.Conflict,
    grpc.StatusCode.PERMISSION_DENIED: errors.Forbidden,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unsupported,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityExceeded,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
}


def status_error(exc: grpc.aio.AioRpcError, what: str, target: str = "") -> errors.DsecError:
    """The DSec error for a failed agent call. Transport errors name the agent's address;
    ``target``'s socket path is replaced by "the agent" (tenants see no host path)."""
    code = dict(exc.trailing_metadata() or ()).get(ERROR_CODE_KEY)
    cls = errors.error_class(code) if code else _STATUS_ERRORS.get(exc.code(), errors.Internal)
    details = exc.details() or exc.code().name
    if target.startswith("unix:"):
        path = target.removeprefix("unix://").removeprefix("unix:")
        details = details.replace(f"unix:{path}", "the agent").replace(path, "the agent")
    return cls(f"{what}: {details}")


async def collect_exec(events: AsyncIterator[pb.ExecEvent], sandbox_id: str = "") -> ExecResult:
    """Gather an Exec stream into one :class:`ExecResult`."""
    out: list[bytes] = []
    err: list[bytes] = []
    async for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "stdout":
            out.append(ev.stdout)
        elif kind == "stderr":
            err.append(ev.stderr)
        else:
            x = ev.exit
            return ExecResult(
                sandbox_id=sandbox_id,
                stdout=b"".join(out),
                stderr=b"".join(err),
                exit_code=x.exit_code,
                duration_s=x.duration_s,
                timed_out=x.timed_out,
                truncated=x.truncated,
            )
    raise errors.Internal("agent ended the exec stream without an exit event")


class AgentClient:
    """An async client for one agent endpoint (``unix:///path`` or ``host:port``).

    Every method raises a :class:`~dsec_kernel.contract.errors.DsecError`, never a gRPC error.
    """

    def __init__(self, target: str) -> None:
        """``target``: ``unix:///path`` (any length) or ``host:port``."""
        self._dir_fd = None
        if target.startswith("unix://"):
            target, self._dir_fd = unix_target(target[len("unix://") :])
        self.target = target
        self._channel = grpc.aio.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        self._stub = AgentStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    async def wait_ready(self, timeout: float) -> pb.HealthResponse:
        """Poll Health until it answers or ``timeout`` seconds pass (then Unavailable)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self._stub.Health(pb.HealthRequest(), timeout=1.0)
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise errors.Unavailable(
                        f"agent at {self.target} did not answer within {timeout:.0f}s: "
                        f"{exc.details()}"
                    ) from None
            await asyncio.sleep(0.02)

    async def exec(self, req: pb.ExecRequest) -> ExecResult:
        """Run a command and collect its output (see ``Agent.Exec`` in agent.proto)."""
        call = self._stub.Exec(req, timeout=deadline.inner(req.timeout_s + 30))
        try:
            return await collect_exec(call, req.sandbox)
        except grpc.aio.AioRpcError as exc:
            raise status_error(exc, "exec", self.target) from None
        except BaseException:
            call.cancel()
            raise

    async def read_file(self, sandbox: str, path: str, max_bytes: int) -> bytes:
        try:
            resp = await self._stub.ReadFile(
                pb.ReadFileRequest(sandbox=sandbox, path=path, max_bytes=max_bytes),
                timeout=deadline.inner(60),
            )
        except grpc.aio.AioRpcError as exc:
            raise status_error(exc, f"read {path}", self.target) from None
        return resp.data

    async def write_file(self, sandbox: str, path: str, data: bytes, mode: int) -> int:
        try:
            resp = await self._stub.WriteFile(
                pb.WriteFileRequest(sandbox=sandbox, path=path, data=data, mode=mode),
                timeout=deadline.inner(60),
            )
        except grpc.aio.AioRpcError as exc:
            raise status_error(exc, f"write {path}", self.target) from None
        return resp.size

    async def signal(self, sandbox: str, signum: int) -> int:
        """Send ``signum`` to every running command of ``sandbox``; how many got it."""
        try:
            resp = await self._stub.Signal(
                pb.SignalRequest(sandbox=sandbox, signal=signum), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            raise status_error(exc, "signal", self.target) from None
        return resp.delivered
