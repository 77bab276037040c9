"""The backend contract: what a sandbox backend plugin implements.

A backend is a class registered under the ``dsec.backends`` entry-point group. The edge
instantiates it with its validated ``Config``, calls :meth:`Backend.start` once, then the
methods below, concurrently, from one asyncio event loop. Every method takes and returns
pydantic models; every failure is a :class:`~dsec_kernel.contract.errors.DsecError`.

Postconditions every backend keeps (the conformance suite, :mod:`dsec_kernel.contract.conformance`,
checks them):

* ``create`` leaves the sandbox ready, or raises having left nothing behind.
* ``destroy`` is idempotent: destroying what is already gone succeeds.
* command output is capped at ``max_output_bytes`` per stream and the cap is reported
  (``truncated``); a command past ``timeout_s`` is killed with everything it started
  (``timed_out``, exit code -9).
* a method whose capability is not declared raises :class:`~.errors.Unsupported`.
* unknown sandbox ids raise :class:`~dsec_kernel.contract.errors.NotFound`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract import errors
from dsec_kernel.contract.config import NoConfig
from dsec_kernel.contract.wire import (
    Capabilities,
    EdgeSandbox,
    ExecRequest,
    ExecResult,
    FncallRequest,
    FsDiff,
    FsDiffRequest,
    LayerInfo,
    Limits,
    PauseReport,
    PublishRequest,
    ReadFileRequest,
    ReadFileResponse,
    RestoreRequest,
    SandboxId,
    SnapshotInfo,
    SnapshotRequest,
    WriteFileRequest,
    WriteFileResponse,
    shell_argv,
)
from dsec_kernel.contract.wire.exec import ExecOptions

if TYPE_CHECKING:
    from dsec_kernel.contract.hooks import Hooks
    from dsec_kernel.contract.wire.sandbox import LayerRef

__all__ = [
    "Backend",
    "BackendContext",
    "Capabilities",
    "ExecCall",
    "SandboxRef",
    "SandboxStatus",
]


def _ignore_lost(sandbox_id: str, reason: str) -> None:
    """The default :attr:`BackendContext.lost`: nobody is told."""


@dataclass(frozen=True)
class BackendContext:
    """What the edge hands a backend at start.

    ``state_dir`` is a directory private to this backend on this node; it survives edge
    restarts. ``hooks`` is the facade over every loaded plugin's hooks. ``lost(sandbox_id,
    reason)`` is called (from the event loop) the moment a backend sees that a sandbox is
    gone by itself (its init died, its VM crashed): the edge reports it lost at once and
    destroys it, so what it held is released. ``reason`` is shown to its tenant: no host
    PIDs or paths.
    """

    node: str
    state_dir: Path
    hooks: Hooks
    lost: Callable[[str, str], None] = _ignore_lost


class SandboxRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sandbox_id: SandboxId


class ExecCall(ExecOptions):
    """One command in one sandbox: an :class:`ExecRequest`'s options as they came, for one
    of its sandboxes (the edge splits a batch into these), its command as an argv."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: SandboxId
    argv: list[str] = Field(min_length=1, description="the request's command (a string: sh -c)")
    limits: Limits = Field(
        default_factory=Limits,
        description="the call's own, over the sandbox's (the edge sets none)",
    )
    tenant: str = Field("", description="whose command it is (backends share slots fairly)")

    @classmethod
    def of(cls, request: ExecRequest, sandbox_id: str, tenant: str) -> ExecCall:
        """The call ``request`` makes in ``sandbox_id``, one of its sandboxes."""
        options = {name: getattr(request, name) for name in _OPTIONS}
        return cls(
            sandbox_id=sandbox_id, argv=shell_argv(request.command), tenant=tenant, **options
        )


_OPTIONS = tuple(ExecOptions.model_fields)  # what ExecCall.of takes from the request as it is


class SandboxStatus(BaseModel):
    model_config = ConfigDict(extra="ignore")

    sandbox_id: SandboxId
    state: str = Field(description="ready | paused | ... (backend's own view)")
    running_execs: int = 0
    layers: list[str] = Field(
        default_factory=list,
        description="after create: the layers it uses, `name:version` if public and "
        "`tenant/name:version` if its tenant's own (placement prefers nodes that have them)",
    )


class Backend(abc.ABC):
    """A sandbox backend. Subclasses set ``name``, ``capabilities`` and ``Config``."""

    #: the entry-point name (``fncall``, ``container``...)
    name: ClassVar[str]
    #: what this backend can do, declared as data
    capabilities: ClassVar[Capabilities]
    #: the backend's configuration model (``extra="forbid"``)
    Config: ClassVar[type[BaseModel]] = NoConfig
    #: run by an edge that is not told which backends to run (False: only when named)
    default_enabled: ClassVar[bool] = True
    #: the backend of a create that names none is the lowest of the cluster's (``dsec up``)
    preference: ClassVar[int] = 100

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = config if config is not None else self.Config()

    # -- availability -----------------------------------------------------------------------

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine (``None``: it can). Cheap; no side effects.

        The edge skips a backend that returns a reason, and prints it.
        """
        return None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, ctx: BackendContext) -> None:  # noqa: B027 - optional hook
        """Called once before any other method. Raise to refuse to start (the edge stops)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the backend started. Sandboxes may be left for a restart to adopt."""

    @abc.abstractmethod
    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        """Create a sandbox with the given id. Ready on return, or raise having cleaned up.

        An id that already exists raises Conflict and leaves that sandbox alone.
        """

    @abc.abstractmethod
    async def destroy(self, ref: SandboxRef) -> None:
        """Destroy a sandbox and everything in it. Idempotent."""

    @abc.abstractmethod
    async def status(self, ref: SandboxRef) -> SandboxStatus:
        """The sandbox's state; NotFound if it does not exist."""

    @abc.abstractmethod
    async def list_sandboxes(self) -> list[str]:
        """Ids of every sandbox this backend holds on this node (for reconciliation)."""

    # -- work inside a sandbox ---------------------------------------------------------------

    async def exec(self, call: ExecCall) -> ExecResult:
        """Run a command; see the module docstring for timeouts and output caps."""
        raise errors.Unsupported(f"the {self.name} backend does not run commands")

    async def fncall(self, request: FncallRequest) -> ExecResult:
        """Run ``request.code`` in a throw-away sandbox (capability ``fncall_languages``)."""
        raise errors.Unsupported(f"the {self.name} backend does not serve fncall")

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        raise errors.Unsupported(f"the {self.name} backend has no files")

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        raise errors.Unsupported(f"the {self.name} backend has no files")

    # -- state -------------------------------------------------------------------------------

    async def snapshot(self, request: SnapshotRequest) -> SnapshotInfo:
        """Record the sandbox's files incrementally; its processes keep running."""
        raise errors.Unsupported(f"the {self.name} backend cannot snapshot")

    async def restore(self, request: RestoreRequest) -> None:
        """Files exactly as at the snapshot (or as created), no process from after it left.
        A snapshot of another tenant is NotFound."""
        raise errors.Unsupported(f"the {self.name} backend cannot restore")

    async def fs_diff(self, request: FsDiffRequest) -> FsDiff:
        """Paths added, modified and deleted since creation or since a snapshot."""
        raise errors.Unsupported(f"the {self.name} backend cannot diff its files")

    async def publish(self, request: PublishRequest) -> LayerInfo:
        """Make a snapshot a layer in the layer store."""
        raise errors.Unsupported(f"the {self.name} backend cannot publish layers")

    async def prestage(self, layers: list[LayerRef], tenant: str | None = None) -> list[str]:
        """Make these layers (as ``tenant`` sees them: its own and public ones; of the kind
        each names, if it names one) ready on this node ahead of sandboxes that will use
        them; returns those it staged, named as in :attr:`SandboxStatus.layers` (a backend
        without layers stages none)."""
        return []

    async def pause(self, ref: SandboxRef) -> PauseReport:
        """Freeze every process of the sandbox and reclaim what memory it can (capability
        ``pause``). Idempotent. The edge never pauses a sandbox while a command runs in it."""
        raise errors.Unsupported(f"the {self.name} backend cannot pause")

    async def resume(self, ref: SandboxRef) -> PauseReport:
        """Thaw a paused sandbox: every process and file as before the pause. Idempotent."""
        raise errors.Unsupported(f"the {self.name} backend cannot resume")
