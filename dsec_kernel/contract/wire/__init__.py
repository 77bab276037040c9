"""Versioned wire messages (pydantic v2). See ``docs/architecture.md`` for the subjects.

``MESSAGES`` lists every top-level message; :func:`parse` reads any of them by its ``type``;
:func:`json_schemas` gives the JSON Schemas that ``dsec schema`` exports and CI checks.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter

from dsec_kernel.contract.wire.base import (
    NAME_PATTERN,
    SANDBOX_ID_PATTERN,
    Error,
    Message,
    Name,
    SandboxId,
    TypedError,
)
from dsec_kernel.contract.wire.exec import (
    DEFAULT_MAX_OUTPUT,
    MAX_FILE_BYTES,
    MAX_OUTPUT,
    MAX_RESPONSE_OUTPUT,
    MAX_TIMEOUT_S,
    ExecRequest,
    ExecResponse,
    ExecResult,
    FncallRequest,
    ReadFileRequest,
    ReadFileResponse,
    WriteFileRequest,
    WriteFileResponse,
    fit_results,
    shell_argv,
)
from dsec_kernel.contract.wire.job import MAX_LEASE_S, JobCloseRequest, JobInfo, JobRenewRequest
from dsec_kernel.contract.wire.layer import PrestageRequest, PrestageResponse
from dsec_kernel.contract.wire.node import (
    BackendInfo,
    Capabilities,
    NodeInfo,
    NodeLoad,
    NodesRequest,
    NodesResponse,
)
from dsec_kernel.contract.wire.pause import (
    PAUSE_REASONS,
    PauseReport,
    PauseRequest,
    PauseResponse,
    ResumeRequest,
)
from dsec_kernel.contract.wire.pool import (
    AcquireRequest,
    AcquireResponse,
    PoolCloseRequest,
    PoolInfo,
    PoolOpenRequest,
    ReleaseRequest,
)
from dsec_kernel.contract.wire.sandbox import (
    MAX_BATCH,
    MAX_TTL_S,
    CreateFailure,
    CreateRequest,
    CreateResponse,
    DestroyRequest,
    DestroyResponse,
    EdgeCreateRequest,
    EdgeCreateResponse,
    EdgeSandbox,
    Env,
    Failure,
    LayerRef,
    Limits,
    ListRequest,
    ListResponse,
    Quota,
    SandboxInfo,
    SandboxSpec,
    StatusRequest,
)
from dsec_kernel.contract.wire.snapshot import (
    CommandRecord,
    FsDiff,
    FsDiffRequest,
    HistoryRequest,
    HistoryResponse,
    LayerInfo,
    PublishRequest,
    RestoreRequest,
    SnapshotId,
    SnapshotInfo,
    SnapshotRequest,
)

MESSAGES: tuple[type[Message], ...] = (
    Error,
    CreateRequest,
    CreateResponse,
    StatusRequest,
    ListRequest,
    ListResponse,
    DestroyRequest,
    DestroyResponse,
    EdgeCreateRequest,
    EdgeCreateResponse,
    ExecRequest,
    ExecResult,
    ExecResponse,
    FncallRequest,
    WriteFileRequest,
    WriteFileResponse,
    ReadFileRequest,
    ReadFileResponse,
    NodeInfo,
    NodesRequest,
    NodesResponse,
    SnapshotRequest,
    SnapshotInfo,
    RestoreRequest,
    FsDiffRequest,
    FsDiff,
    HistoryRequest,
    HistoryResponse,
    PublishRequest,
    LayerInfo,
    PauseRequest,
    ResumeRequest,
    PauseResponse,
    JobRenewRequest,
    JobInfo,
    JobCloseRequest,
    PoolOpenRequest,
    PoolInfo,
    AcquireRequest,
    AcquireResponse,
    ReleaseRequest,
    PoolCloseRequest,
    PrestageRequest,
    PrestageResponse,
)

AnyMessage = Annotated[Union[MESSAGES], Field(discriminator="type")]  # type: ignore[valid-type]  # noqa: UP007
_any = TypeAdapter(AnyMessage)


def parse(data: bytes | str) -> Message:
    """Parse any wire message into its model, chosen by its ``type``."""
    return _any.validate_json(data)


def type_name(model: type[Message]) -> str:
    return model.model_fields["type"].default


def json_schemas() -> dict[str, dict[str, Any]]:
    """``{type string: JSON Schema}`` for every message."""
    return {type_name(m): m.model_json_schema() for m in MESSAGES}


__all__ = [
    "DEFAULT_MAX_OUTPUT",
    "MAX_BATCH",
    "MAX_FILE_BYTES",
    "MAX_LEASE_S",
    "MAX_OUTPUT",
    "MAX_RESPONSE_OUTPUT",
    "MAX_TIMEOUT_S",
    "MAX_TTL_S",
    "MESSAGES",
    "NAME_PATTERN",
    "PAUSE_REASONS",
    "SANDBOX_ID_PATTERN",
    "AcquireRequest",
    "AcquireResponse",
    "AnyMessage",
    "BackendInfo",
    "Capabilities",
    "CommandRecord",
    "CreateFailure",
    "CreateRequest",
    "CreateResponse",
    "DestroyRequest",
    "DestroyResponse",
    "EdgeCreateRequest",
    "EdgeCreateResponse",
    "EdgeSandbox",
    "Env",
    "Error",
    "ExecRequest",
    "ExecResponse",
    "ExecResult",
    "Failure",
    "FncallRequest",
    "FsDiff",
    "FsDiffRequest",
    "HistoryRequest",
    "HistoryResponse",
    "JobCloseRequest",
    "JobInfo",
    "JobRenewRequest",
    "LayerInfo",
    "LayerRef",
    "Limits",
    "ListRequest",
    "ListResponse",
    "Message",
    "Name",
    "NodeInfo",
    "NodeLoad",
    "NodesRequest",
    "NodesResponse",
    "PauseReport",
    "PauseRequest",
    "PauseResponse",
    "PoolCloseRequest",
    "PoolInfo",
    "PoolOpenRequest",
    "PrestageRequest",
    "PrestageResponse",
    "PublishRequest",
    "Quota",
    "ReadFileRequest",
    "ReadFileResponse",
    "ReleaseRequest",
    "RestoreRequest",
    "ResumeRequest",
    "SandboxId",
    "SandboxInfo",
    "SandboxSpec",
    "SnapshotId",
    "SnapshotInfo",
    "SnapshotRequest",
    "StatusRequest",
    "TypedError",
    "WriteFileRequest",
    "WriteFileResponse",
    "fit_results",
    "json_schemas",
    "parse",
    "shell_argv",
]
