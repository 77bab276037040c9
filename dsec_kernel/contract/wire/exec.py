"""Commands, stateless calls and file operations."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from dsec_kernel.contract.wire.base import SANDBOX_ID_PATTERN, Message, SandboxId, TypedError
from dsec_kernel.contract.wire.sandbox import MAX_BATCH, Limits

__all__ = [
    "DEFAULT_MAX_OUTPUT",
    "MAX_COMMAND_LINE",
    "MAX_FILE_BYTES",
    "MAX_OUTPUT",
    "MAX_RESPONSE_OUTPUT",
    "MAX_TIMEOUT_S",
    "ExecOptions",
    "ExecRequest",
    "ExecResponse",
    "ExecResult",
    "FncallRequest",
    "ReadFileRequest",
    "ReadFileResponse",
    "WriteFileRequest",
    "WriteFileResponse",
    "fit_results",
    "shell_argv",
]

MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_MAX_OUTPUT = 1 << 20
#: Largest per-stream output cap a caller may ask for (both streams must fit one NATS message).
MAX_OUTPUT = 8 << 20
#: Largest file one read_file / write_file moves.
MAX_FILE_BYTES = 16 << 20
#: Most bytes of a command's argv, env and cwd together (Linux takes 2 MiB at most)
MAX_COMMAND_LINE = 1 << 20
#: Most bytes of stdin one exec request feeds all its sandboxes together
MAX_BATCH_STDIN = 64 << 20
#: Most output one ExecResponse carries over all its results (it must fit one NATS message).
MAX_RESPONSE_OUTPUT = 24 << 20

Timeout = Field(60.0, gt=0, le=MAX_TIMEOUT_S, description="seconds before the command is killed")
OutputCap = Field(
    DEFAULT_MAX_OUTPUT,
    ge=0,
    le=MAX_OUTPUT,
    description="bytes kept per stream; the rest is read and discarded and `truncated` is set",
)


def fit_results(results: list[ExecResult], budget: int = MAX_RESPONSE_OUTPUT) -> list[ExecResult]:
    """Cut the longest outputs until all results together hold at most ``budget`` bytes.

    Every stream keeps the same share (the longest are cut to one common length); a result
    that lost bytes is marked ``truncated``.
    """
    sizes = sorted(len(s) for r in results for s in (r.stdout, r.stderr))
    if sum(sizes) <= budget:
        return results
    cap, left, n = 0, budget, len(sizes)
    for i, size in enumerate(sizes):  # the largest common cap the budget allows
        if size * (n - i) > left:
            cap = left // (n - i)
            break
        left -= size
    return [
        r
        if len(r.stdout) <= cap and len(r.stderr) <= cap
        else r.model_copy(
            update={"stdout": r.stdout[:cap], "stderr": r.stderr[:cap], "truncated": True}
        )
        for r in results
    ]


def shell_argv(command: str | list[str]) -> list[str]:
    """The argv a command stands for: a string runs under ``/bin/sh -c``."""
    return ["/bin/sh", "-c", command] if isinstance(command, str) else command


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"bad environment variable {k!r}")
    return env


EnvVars = Annotated[dict[str, str], AfterValidator(_check_env)]


class ExecOptions(BaseModel):
    """How a command runs, in each sandbox it is sent to: what an :class:`ExecRequest` gives
    every one of its sandboxes and the backend's ``ExecCall`` receives as it is (so a field
    added here reaches the backends with no other edit)."""

    timeout_s: float = Timeout
    env: EnvVars = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = Field(None, description="user name or uid to run as, if the backend can")
    stdin: bytes = b""
    max_output_bytes: int = OutputCap


class ExecRequest(ExecOptions, Message):
    """Run one command in each of ``sandbox_ids`` (one sandbox, or many at once)."""

    type: Literal["io.dsec.exec.v1.exec_request"] = "io.dsec.exec.v1.exec_request"
    sandbox_ids: list[SandboxId] = Field(min_length=1, max_length=MAX_BATCH)
    command: str | list[str] = Field(description="argv, or a string for /bin/sh -c")
    request_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="the caller's id for this command: sent again, it is not run again; "
        "the first run's result comes back",
    )

    @field_validator("command")
    @classmethod
    def _nonempty(cls, command: str | list[str]) -> str | list[str]:
        if not command or (isinstance(command, list) and not command[0]):
            raise ValueError("command is empty")
        if any("\0" in a for a in ([command] if isinstance(command, str) else command)):
            raise ValueError("command contains a NUL byte")
        return command

    @model_validator(mode="after")
    def _fits_a_command_line(self) -> ExecRequest:
        words = [self.command] if isinstance(self.command, str) else self.command
        words = [*words, *self.env, *self.env.values(), self.cwd or ""]
        size = sum(len(w.encode(errors="surrogatepass")) for w in words)
        if size > MAX_COMMAND_LINE:
            raise ValueError(
                f"command, env and cwd take {size} bytes; at most {MAX_COMMAND_LINE} "
                "(pass data on stdin or in a file)"
            )
        if len(self.stdin) * len(self.sandbox_ids) > MAX_BATCH_STDIN:
            raise ValueError(
                f"{len(self.stdin)} bytes of stdin for each of {len(self.sandbox_ids)} "
                f"sandboxes is over {MAX_BATCH_STDIN} in all; write the input to a file in each"
            )
        return self


class ExecResult(Message):
    """A finished command. A command killed at its timeout has ``timed_out`` and exit_code -9.

    ``error`` is set (and the rest empty) for a sandbox the command could not run in: a
    batch's entry for it (``exec_many``) carries it, ``Sandbox.exec`` raises it.
    """

    type: Literal["io.dsec.exec.v1.exec_result"] = "io.dsec.exec.v1.exec_result"
    sandbox_id: str = ""
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int = 0
    duration_s: float = 0.0
    timed_out: bool = False
    truncated: bool = Field(False, description="output beyond max_output_bytes was discarded")
    error: TypedError | None = Field(None, description="why the command could not run there")


class ExecResponse(Message):
    type: Literal["io.dsec.exec.v1.exec_response"] = "io.dsec.exec.v1.exec_response"
    results: list[ExecResult]


class FncallRequest(Message):
    """A stateless call: run ``code`` in a fresh, throw-away sandbox and return its result."""

    type: Literal["io.dsec.exec.v1.fncall_request"] = "io.dsec.exec.v1.fncall_request"
    code: str = Field(min_length=1, max_length=MAX_FILE_BYTES)
    language: str = Field("python", pattern=r"^[a-z0-9_+-]{1,32}$")
    timeout_s: float = Timeout
    env: EnvVars = Field(default_factory=dict)
    stdin: bytes = b""
    max_output_bytes: int = OutputCap
    limits: Limits = Field(default_factory=Limits)
    sandbox_id: str | None = Field(
        None, pattern=SANDBOX_ID_PATTERN, description="run with this sandbox's files"
    )
    tenant: str | None = Field(None, description="set by the apiserver")


class WriteFileRequest(Message):
    type: Literal["io.dsec.file.v1.write_request"] = "io.dsec.file.v1.write_request"
    sandbox_id: SandboxId
    path: str = Field(min_length=2, max_length=4096, pattern=r"^/")
    data: bytes = Field(max_length=MAX_FILE_BYTES)
    mode: int = Field(0o644, ge=0, le=0o777, description="permission bits (no setuid/setgid)")


class WriteFileResponse(Message):
    type: Literal["io.dsec.file.v1.write_response"] = "io.dsec.file.v1.write_response"
    size: int


class ReadFileRequest(Message):
    type: Literal["io.dsec.file.v1.read_request"] = "io.dsec.file.v1.read_request"
    sandbox_id: SandboxId
    path: str = Field(min_length=2, max_length=4096, pattern=r"^/")


class ReadFileResponse(Message):
    type: Literal["io.dsec.file.v1.read_response"] = "io.dsec.file.v1.read_response"
    data: bytes
