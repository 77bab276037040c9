"""Nodes, their backends' declared capabilities, and heartbeats."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec_kernel.contract.wire.base import NAME_PATTERN, Message, Name

__all__ = ["BackendInfo", "Capabilities", "NodeInfo", "NodeLoad", "NodesRequest", "NodesResponse"]


class Capabilities(BaseModel):
    """What a backend declares it can do. The edge publishes it; the apiserver routes by it.

    A method whose capability is False must raise :class:`~dsec_kernel.contract.errors.Unsupported`.
    ``Capabilities(...)`` refuses a field it does not have (a backend's ``snapshots=True`` is
    a typo, not a capability); read from the wire within :class:`BackendInfo`, fields a newer
    edge declares are dropped.
    """

    # (its schema says what the wire takes: unknown fields are dropped there)
    model_config = ConfigDict(
        extra="forbid", json_schema_extra=lambda schema: schema.pop("additionalProperties")
    )

    exec: bool = Field(True, description="runs commands (exec)")
    files: bool = Field(True, description="read_file / write_file")
    stateful: bool = Field(
        True, description="what one exec writes or starts is still there for the next exec"
    )
    fncall_languages: list[str] = Field(
        default_factory=list, description="languages served by stateless fncall"
    )
    snapshot: bool = Field(False, description="snapshot, and restore to its snapshots")
    restore: bool = Field(False, description="restore to a snapshot or to its clean state")
    fork: bool = Field(False, description="create sandboxes from a snapshot")
    fs_diff: bool = Field(False, description="report changed paths")
    pause: bool = False
    isolation: list[str] = Field(
        default_factory=list, description="mechanisms used, e.g. pid, mnt, net, seccomp, rlimits"
    )
    max_sandboxes: int = Field(1000, ge=0, description="sandboxes this backend holds on one node")


class BackendInfo(BaseModel):
    """A backend as an edge runs it: name, plugin version and capabilities."""

    model_config = ConfigDict(extra="ignore")

    name: Name
    version: str = ""
    capabilities: Capabilities = Field(default_factory=Capabilities)

    @field_validator("capabilities", mode="before")
    @classmethod
    def _known(cls, value: object) -> object:
        """Of a record (a newer edge's, say), the capabilities this release knows."""
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if k in Capabilities.model_fields}
        return value


class NodeLoad(BaseModel):
    """Load figures an edge measures at each heartbeat."""

    model_config = ConfigDict(extra="ignore")

    sandboxes: int = 0
    paused: int = Field(0, description="of them, paused (frozen, memory reclaimed)")
    by_backend: dict[str, int] = Field(default_factory=dict)
    paused_by_backend: dict[str, int] = Field(default_factory=dict)
    reclaimed_mb: int = Field(0, description="memory the paused sandboxes gave back")
    running_execs: int = 0
    cpu_load: float = Field(0.0, description="1-minute load average divided by CPU count")
    mem_available_mb: int = 0


class NodeInfo(Message):
    """A node's record in KV (bucket ``dsec-nodes``), rewritten by its edge every heartbeat.

    ``state`` is ``up`` while heartbeats arrive; an apiserver sets ``down`` when they stop
    for longer than the node timeout, and reports the node's sandboxes lost. An edge that
    stops on purpose (a restart, an upgrade) sets ``stopping_since``: its sandboxes stay, it
    gets no new work, and it is marked down only if it is not back within the apiservers'
    restart grace.
    """

    type: Literal["io.dsec.node.v1.info"] = "io.dsec.node.v1.info"
    node: Name
    edge_id: str = Field(description="random id of the edge process; changes on restart")
    state: Literal["up", "down"] = "up"
    pool: str = Field("default", pattern=NAME_PATTERN, description="node pool label")
    layers: list[str] = Field(
        default_factory=list,
        description="layers lately used or staged here: name:version if public, "
        "tenant/name:version if a tenant's own (a tenant sees its own and the public ones)",
    )
    labels: dict[str, str] = Field(default_factory=dict)
    backends: list[BackendInfo] = Field(default_factory=list)
    cpus: int = 1
    memory_mb: int = 0
    load: NodeLoad = Field(default_factory=NodeLoad)
    started_at: float = 0.0
    heartbeat_at: float = Field(0.0, description="when the edge counted what this says")
    alive_at: float = Field(0.0, description="when its edge's process last said it lives")
    heartbeat_s: float = Field(1.0, description="interval between heartbeats")
    version: str = ""
    stopping_since: float | None = Field(
        None, description="when its edge stopped on purpose (None: it runs)"
    )

    @property
    def serving(self) -> bool:
        """Up, and its edge running: it takes new work."""
        return self.state == "up" and self.stopping_since is None

    def backend(self, name: str) -> BackendInfo | None:
        return next((b for b in self.backends if b.name == name), None)


class NodesRequest(Message):
    type: Literal["io.dsec.node.v1.nodes_request"] = "io.dsec.node.v1.nodes_request"


class NodesResponse(Message):
    type: Literal["io.dsec.node.v1.nodes_response"] = "io.dsec.node.v1.nodes_response"
    nodes: list[NodeInfo] = Field(default_factory=list)
