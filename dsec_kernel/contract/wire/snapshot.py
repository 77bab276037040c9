"""Sandbox state: snapshots, restore, filesystem diffs, command history, publishing layers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract.wire.base import Message, Name, SandboxId, SnapshotId

__all__ = [
    "CommandRecord",
    "FsDiff",
    "FsDiffRequest",
    "HistoryRequest",
    "HistoryResponse",
    "LayerInfo",
    "PublishRequest",
    "RestoreRequest",
    "SnapshotId",
    "SnapshotInfo",
    "SnapshotRequest",
]


class SnapshotRequest(Message):
    """Record the sandbox's files now. Processes keep running; the snapshot holds only what
    changed since the sandbox's previous snapshot (or since it started)."""

    type: Literal["io.dsec.snapshot.v1.snapshot_request"] = "io.dsec.snapshot.v1.snapshot_request"
    sandbox_id: SandboxId
    keep: bool = Field(False, description="keep it after the sandbox is gone, until deleted")


class SnapshotInfo(Message):
    type: Literal["io.dsec.snapshot.v1.snapshot_info"] = "io.dsec.snapshot.v1.snapshot_info"
    id: SnapshotId
    sandbox_id: SandboxId
    tenant: Name
    backend: Name
    parent: SnapshotId | None = None
    depth: int = Field(1, description="snapshots in its chain, itself included")
    created_at: float
    bytes: int = Field(0, description="bytes this snapshot itself stores")


class RestoreRequest(Message):
    """Put the sandbox back exactly as at ``snapshot_id`` (None: as it was created): files as
    then, and no process started since left running."""

    type: Literal["io.dsec.snapshot.v1.restore_request"] = "io.dsec.snapshot.v1.restore_request"
    sandbox_id: SandboxId
    snapshot_id: SnapshotId | None = None


class FsDiffRequest(Message):
    type: Literal["io.dsec.snapshot.v1.fs_diff_request"] = "io.dsec.snapshot.v1.fs_diff_request"
    sandbox_id: SandboxId
    since: SnapshotId | None = Field(None, description="None: since the sandbox was created")


class FsDiff(Message):
    """Paths (absolute, inside the sandbox) that differ from the reference state."""

    type: Literal["io.dsec.snapshot.v1.fs_diff"] = "io.dsec.snapshot.v1.fs_diff"
    added: list[str] = Field(default_factory=list)
    modified: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)


class CommandRecord(BaseModel):
    """One entry of a sandbox's trajectory: a command and its result, or a snapshot or
    restore (``kind``), in the order the edge saw them. Output is kept up to a cap
    (``stdout_bytes`` / ``stderr_bytes`` give the full sizes)."""

    model_config = ConfigDict(extra="ignore", ser_json_bytes="base64", val_json_bytes="base64")

    kind: Literal["exec", "snapshot", "restore"] = "exec"
    seq: int = Field(0, description="position in the log (set when read)")
    request_id: str | None = None
    argv: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout_s: float = 0.0
    stdin: bytes = b""
    started_at: float
    duration_s: float = 0.0
    exit_code: int = 0
    timed_out: bool = False
    truncated: bool = False
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    snapshot_id: str | None = Field(None, description="snapshot taken, or restored to")


class HistoryRequest(Message):
    """A sandbox's trajectory; answered from the log, so also for a lost or destroyed one
    (for as long as the log keeps it)."""

    type: Literal["io.dsec.snapshot.v1.history_request"] = "io.dsec.snapshot.v1.history_request"
    sandbox_id: SandboxId


class HistoryResponse(Message):
    type: Literal["io.dsec.snapshot.v1.history_response"] = "io.dsec.snapshot.v1.history_response"
    commands: list[CommandRecord] = Field(default_factory=list)


class PublishRequest(Message):
    """Make a snapshot a layer that later sandboxes can use (DSec's pack_diff). A workspace
    (or toolkit) layer holds everything above the sandbox's base; a base layer everything."""

    type: Literal["io.dsec.snapshot.v1.publish_request"] = "io.dsec.snapshot.v1.publish_request"
    snapshot_id: SnapshotId
    kind: Literal["base", "workspace", "toolkit"]
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
    tenant: Name | None = Field(None, description="set by the apiserver")


class LayerInfo(Message):
    type: Literal["io.dsec.snapshot.v1.layer_info"] = "io.dsec.snapshot.v1.layer_info"
    digest: str
    kind: str
    name: str
    version: str
    size: int
