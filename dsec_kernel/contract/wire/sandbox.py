"""Sandbox lifecycle messages: create (in batches), status, list, destroy."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StringConstraints,
    model_validator,
)

from dsec_kernel.contract.wire.base import Error, Message, Name, SandboxId, SnapshotId

__all__ = [
    "LAYER_KINDS",
    "LAYER_NAME_PATTERN",
    "LAYER_REF_PATTERN",
    "LAYER_VERSION_PATTERN",
    "MAX_BATCH",
    "MAX_TTL_S",
    "CreateFailure",
    "CreateRequest",
    "CreateResponse",
    "DestroyRequest",
    "DestroyResponse",
    "EdgeCreateRequest",
    "EdgeCreateResponse",
    "EdgeSandbox",
    "Env",
    "Failure",
    "LayerKind",
    "LayerRef",
    "Limits",
    "ListRequest",
    "ListResponse",
    "Quota",
    "SandboxInfo",
    "SandboxSpec",
    "StatusRequest",
]

#: Most sandboxes one create request may ask for; the SDK splits bigger counts into batches.
MAX_BATCH = 1000
#: Longest lifetime a sandbox may ask for (7 days).
MAX_TTL_S = 7 * 24 * 3600.0


class Limits(BaseModel):
    """Resource limits for a sandbox (``None``: the backend's default)."""

    model_config = ConfigDict(extra="forbid")

    cpus: float | None = Field(None, gt=0, le=1024, description="CPU quota in cores")
    memory_mb: int | None = Field(None, ge=16, le=1 << 20, description="memory limit")
    pids: int | None = Field(None, ge=1, le=1 << 16, description="most processes at once")
    file_size_mb: int | None = Field(None, ge=1, le=1 << 20, description="largest file written")
    disk_mb: int | None = Field(
        None, ge=16, le=1 << 24, description="what the sandbox's files may take on the node's disk"
    )
    inodes: int | None = Field(
        None, ge=64, le=1 << 30, description="most files, directories and links its writes hold"
    )


#: labels: at most 64, keys of 1-128 characters, values of at most 256 (a sandbox's labels
#: are in its record, which every apiserver mirrors)
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
LabelValue = Annotated[str, StringConstraints(max_length=256)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=64)]

#: a layer's name and version, as the layer store has them
LAYER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
LAYER_VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"
#: the short form a user may write a layer reference in: ``name:version``
LAYER_REF_PATTERN = f"{LAYER_NAME_PATTERN[:-1]}:{LAYER_VERSION_PATTERN[1:]}"
#: what a layer holds: an OS and runtimes, a task's files, or tools and a harness
LayerKind = Literal["base", "workspace", "toolkit"]
LAYER_KINDS: tuple[LayerKind, ...] = get_args(LayerKind)


class LayerRef(BaseModel):
    """A layer that a sandbox's env or a prestage names: its ``name`` and ``version``, and
    the ``kind`` it must be (None: whichever it is; a layer of an :class:`Env` always has
    the kind of its place there).

    Whose layer it is is not part of the reference: resolved as a tenant, it is the public
    layer of that name and version if there is one, else the tenant's own
    (:mod:`dsec_kernel.contract.store`). A node lists the layers it has as
    :meth:`listed_as` says.

    Where people write layers (``dsec.Env(base="debian-python:12")``, the command line, a
    prestage) the short form ``"name:version"`` is taken too, and made this model when the
    message is made; what comes after handles only the model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=LAYER_NAME_PATTERN)
    version: str = Field(pattern=LAYER_VERSION_PATTERN)
    kind: LayerKind | None = None

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        if isinstance(value, str):
            name, sep, version = value.partition(":")
            if not sep:
                raise ValueError(f"layer {value!r} is not name:version (such as debian-python:12)")
            return {"name": name, "version": version}
        return value

    @classmethod
    def __get_pydantic_json_schema__(cls, core: Any, handler: GetJsonSchemaHandler) -> Any:
        schema = handler(core)
        if handler.mode == "serialization":
            return schema
        return {"anyOf": [schema, {"type": "string", "pattern": LAYER_REF_PATTERN}]}

    def __str__(self) -> str:
        return f"{self.name}:{self.version}"

    def listed_as(self, owner: str | None) -> str:
        """The layer as a node lists it (``NodeInfo.layers``, ``SandboxStatus.layers``) when
        ``owner`` has it: ``name:version`` if public (None), ``owner/name:version`` if a
        tenant's own."""
        return f"{owner}/{self}" if owner else str(self)


def _placed(kind: LayerKind) -> AfterValidator:
    """A layer in the env's place for ``kind``: of that kind (given none, it is given it)."""

    def check(ref: LayerRef) -> LayerRef:
        if ref.kind is None:
            return ref.model_copy(update={"kind": kind})
        if ref.kind != kind:
            raise ValueError(f"layer {ref} is named as a {ref.kind} layer, in the {kind}'s place")
        return ref

    return AfterValidator(check)


class Env(BaseModel):
    """An environment: layers composed when the sandbox starts, the base lowest, then the
    workspace, then the toolkits in order (later ones win). Each is a :class:`LayerRef`
    (or its short form ``"name:version"``) of the kind its place says."""

    model_config = ConfigDict(extra="forbid")

    base: Annotated[LayerRef, _placed("base")]
    workspace: Annotated[LayerRef, _placed("workspace")] | None = None
    toolkits: list[Annotated[LayerRef, _placed("toolkit")]] = Field(
        default_factory=list, max_length=16
    )

    def refs(self) -> list[LayerRef]:
        """Its layers from the top one down, each with its kind."""
        top = list(reversed(self.toolkits))
        return [*top, *([self.workspace] if self.workspace else []), self.base]


class SandboxSpec(BaseModel):
    """What to create. Backends read only the fields they understand."""

    model_config = ConfigDict(extra="forbid")

    backend: Name | None = Field(None, description="None: the cluster's default backend")
    ttl_s: float | None = Field(
        None, gt=0, le=MAX_TTL_S, description="destroyed this long after creation"
    )
    idle_ttl_s: float | None = Field(
        None, gt=0, le=MAX_TTL_S, description="paused after this long without a command"
    )
    job: Name | None = Field(None, description="the job (trainer lease) it belongs to")
    limits: Limits = Field(default_factory=Limits)
    labels: Labels = Field(default_factory=dict)
    env: Env | None = Field(None, description="layers to compose (container, VM backends)")
    network: Literal["none", "egress"] = Field(
        "none", description="none: no interface but lo; egress: a veth to the node's bridge"
    )
    snapshot: SnapshotId | None = Field(None, description="start from this snapshot (fork)")


class SandboxInfo(BaseModel):
    """A sandbox's record (KV bucket ``dsec-sandboxes``, key = id).

    ``state`` is ``ready``, ``paused`` (frozen, memory reclaimed; ``paused_reason`` says
    why) or ``lost`` (its node went down; files and processes are gone). Later versions may
    add states; treat unknown ones as not usable. A sandbox of a warm pool has ``pool`` set,
    and ``in_pool`` while it waits there to be acquired.
    """

    model_config = ConfigDict(extra="ignore")

    id: SandboxId
    tenant: Name
    backend: str
    node: str
    state: str = "ready"
    created_at: float
    expires_at: float | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    job: str | None = None
    idle_ttl_s: float | None = None
    paused_reason: str | None = None
    spec: SandboxSpec | None = Field(None, description="what it was created from")
    pool: str | None = Field(None, description="the warm pool it belongs to")
    in_pool: bool = Field(False, description="idle in its pool, not acquired")
    request_id: str | None = Field(None, description="the create request that made it")


class Failure(BaseModel):
    """One item of a batch that failed, with the error that would have been raised."""

    model_config = ConfigDict(extra="ignore")

    id: str
    error: Error


class CreateRequest(Message):
    """Create ``count`` sandboxes alike: all of them, or none (an error); with ``partial``,
    those that can be made, the others reported in ``failed``. Either way a sandbox that
    could not be made leaves nothing behind.

    If the cluster has no room now, the request waits in the admission queue (in order of
    its job's priority, then arrival) for up to ``wait_s``; then it fails with a retryable
    CapacityExceeded. A tenant's queue is bounded: past it, QueueFull at once.
    """

    type: Literal["io.dsec.sandbox.v1.create_request"] = "io.dsec.sandbox.v1.create_request"
    spec: SandboxSpec
    count: int = Field(1, ge=1, le=MAX_BATCH)
    wait_s: float = Field(30.0, ge=0, le=600, description="longest wait in the admission queue")
    request_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="the caller's id for this create: sent again, the same sandboxes come back",
    )
    partial: bool = Field(
        False,
        description="keep the sandboxes that could be made (as many as the quota allows, and "
        "those the nodes made) and report the rest in the response's failed; an error only "
        "if none could be made",
    )


class CreateFailure(BaseModel):
    """``count`` sandboxes of a partial create that were not made, and the error they met."""

    model_config = ConfigDict(extra="ignore")

    count: int = Field(ge=1)
    error: Error


class CreateResponse(Message):
    type: Literal["io.dsec.sandbox.v1.create_response"] = "io.dsec.sandbox.v1.create_response"
    sandboxes: list[SandboxInfo]
    failed: list[CreateFailure] = Field(
        default_factory=list, description="of a partial create: the sandboxes not made"
    )
    queued_s: float = Field(0.0, description="time spent in the admission queue")
    queue_position: int = Field(0, description="place in the queue on arrival (0: none)")


class Quota(BaseModel):
    """A tenant's limits (KV bucket ``dsec-quotas``); None: no limit."""

    model_config = ConfigDict(extra="forbid")

    sandboxes: int | None = Field(None, ge=0)
    cpus: float | None = Field(None, ge=0, description="sum of the sandboxes' CPU limits")
    memory_mb: int | None = Field(None, ge=0, description="sum of their memory limits")
    max_priority: int | None = Field(
        None,
        ge=0,
        le=100,
        description="highest priority its jobs have over other tenants' "
        "work (None: the apiserver's priority_ceiling, 0 by default); their own priorities "
        "still order its own work",
    )


class StatusRequest(Message):
    type: Literal["io.dsec.sandbox.v1.status_request"] = "io.dsec.sandbox.v1.status_request"
    id: SandboxId


class ListRequest(Message):
    """One page of the caller's sandboxes, by id: those after ``after``."""

    type: Literal["io.dsec.sandbox.v1.list_request"] = "io.dsec.sandbox.v1.list_request"
    labels: Labels = Field(default_factory=dict, description="only sandboxes with these")
    after: str | None = Field(None, max_length=64, description="the previous page's next")
    limit: int = Field(MAX_BATCH, ge=1, le=MAX_BATCH, description="most sandboxes on the page")


class ListResponse(Message):
    type: Literal["io.dsec.sandbox.v1.list_response"] = "io.dsec.sandbox.v1.list_response"
    sandboxes: list[SandboxInfo]
    next: str | None = Field(None, description="set when there are more: ask again after it")


class DestroyRequest(Message):
    """Destroy sandboxes. Idempotent: ids already gone are reported in ``not_found``, not as
    an error; those whose node could not destroy them now, in ``failed`` (their records
    stay: destroy them again)."""

    type: Literal["io.dsec.sandbox.v1.destroy_request"] = "io.dsec.sandbox.v1.destroy_request"
    ids: list[SandboxId] = Field(max_length=MAX_BATCH)


class DestroyResponse(Message):
    type: Literal["io.dsec.sandbox.v1.destroy_response"] = "io.dsec.sandbox.v1.destroy_response"
    destroyed: list[str] = Field(default_factory=list)
    not_found: list[str] = Field(default_factory=list)
    failed: list[Failure] = Field(default_factory=list)


class EdgeSandbox(BaseModel):
    """One sandbox an apiserver asks an edge to create (ids are chosen by the apiserver)."""

    model_config = ConfigDict(extra="ignore")

    id: SandboxId
    tenant: Name
    spec: SandboxSpec
    created_at: float
    expires_at: float | None = None


class EdgeCreateRequest(Message):
    """apiserver → edge: create these sandboxes on this node, in one batch."""

    type: Literal["io.dsec.edge.v1.create_request"] = "io.dsec.edge.v1.create_request"
    sandboxes: list[EdgeSandbox] = Field(max_length=MAX_BATCH)


class EdgeCreateResponse(Message):
    type: Literal["io.dsec.edge.v1.create_response"] = "io.dsec.edge.v1.create_response"
    created: list[SandboxInfo] = Field(default_factory=list)
    failed: list[Failure] = Field(default_factory=list)
    completed_at: float = Field(
        0.0, description="edge clock when done: its heartbeats from then on count these"
    )
