"""The no-op backend: sandboxes that are only records (for control-plane tests)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, Capabilities, SandboxRef, SandboxStatus
from dsec_kernel.contract.wire import EdgeSandbox

__all__ = ["NoopBackend", "NoopConfig"]


class NoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_sandboxes: int = Field(1_000_000, ge=1)


class NoopBackend(Backend):
    name = "noop"
    capabilities = Capabilities(exec=False, files=False, stateful=False, isolation=[])
    Config = NoopConfig
    default_enabled: ClassVar[bool] = False

    def __init__(self, config: NoopConfig | None = None) -> None:
        super().__init__(config)
        self.capabilities = Capabilities(
            exec=False, files=False, stateful=False, max_sandboxes=self.config.max_sandboxes
        )
        self._ids: set[str] = set()

    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        if sandbox.id in self._ids:
            raise errors.Conflict(f"sandbox {sandbox.id} already exists")
        if len(self._ids) >= self.config.max_sandboxes:
            raise errors.CapacityExceeded(f"noop holds at most {self.config.max_sandboxes}")
        self._ids.add(sandbox.id)
        return SandboxStatus(sandbox_id=sandbox.id, state="ready")

    async def destroy(self, ref: SandboxRef) -> None:
        self._ids.discard(ref.sandbox_id)

    async def status(self, ref: SandboxRef) -> SandboxStatus:
        if ref.sandbox_id not in self._ids:
            raise errors.NotFound(f"no sandbox {ref.sandbox_id}")
        return SandboxStatus(sandbox_id=ref.sandbox_id, state="ready")

    async def list_sandboxes(self) -> list[str]:
        return sorted(self._ids)
