"""The typed facade over hooks (pluggy): the only way kernel code calls them.

Hook specifications are in :mod:`dsec_kernel.contract.hookspecs`; a plugin marks its
implementations with :data:`~dsec_kernel.contract.hookspecs.hookimpl`. The kernel builds the
facade with :func:`dsec_kernel.loader.load_hooks` (which also registers the installed guards).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from dsec_kernel.contract import hookspecs

if TYPE_CHECKING:
    from dsec_kernel.contract.placement import NodeView, PlacementRequest
    from dsec_kernel.contract.store import Layer
    from dsec_kernel.contract.wire import ExecRequest, NodeInfo, SandboxInfo
    from dsec_kernel.contract.wire.sandbox import LayerRef

__all__ = ["Hooks"]

log = logging.getLogger(__name__)


async def _await_me_maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Hooks:
    """The typed facade: the only way kernel code calls hooks.

    Build it with :meth:`of` (the given plugin objects) or
    :func:`dsec_kernel.loader.load_hooks` (those and the installed guards).
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm

    @classmethod
    def of(cls, plugins: Iterable[object] = ()) -> Hooks:
        """A facade with ``plugins`` registered (a class is instantiated first). A ``dsec_*``
        method that is no known hook raises pluggy's PluginValidationError: a misspelt
        hook fails at start-up."""
        pm = pluggy.PluginManager("dsec")
        pm.add_hookspecs(hookspecs)
        for obj in plugins:
            obj = obj() if inspect.isclass(obj) else obj
            if not pm.is_registered(obj):
                pm.register(obj)
        pm.check_pending()
        return cls(pm)

    def register(self, plugin: object) -> None:
        """Register one more plugin object (its hooks must be known)."""
        if not self.pm.is_registered(plugin):
            self.pm.register(plugin)
            self.pm.check_pending()

    # -- lifecycle ---------------------------------------------------------------------------

    def configure(self, role: str, node: str | None) -> None:
        self.pm.hook.dsec_configure.call_historic(kwargs={"role": role, "node": node})

    async def sandbox_created(self, sandbox: SandboxInfo) -> None:
        await self._notify(self.pm.hook.dsec_sandbox_created, sandbox=sandbox)

    async def sandbox_destroyed(self, sandbox: SandboxInfo, reason: str) -> None:
        await self._notify(self.pm.hook.dsec_sandbox_destroyed, sandbox=sandbox, reason=reason)

    async def node_down(self, node: NodeInfo, lost: list[str]) -> None:
        await self._notify(self.pm.hook.dsec_node_down, node=node, lost=lost)

    # -- placement (synchronous: called for every candidate node) ----------------------------

    def placement_filter(self, node: NodeView, request: PlacementRequest) -> bool:
        return False not in self.pm.hook.dsec_placement_filter(node=node, request=request)

    def placement_score(self, node: NodeView, request: PlacementRequest) -> float:
        results = self.pm.hook.dsec_placement_score(node=node, request=request)
        return float(sum(r for r in results if r is not None))

    # -- storage -----------------------------------------------------------------------------

    async def layer_resolve(self, tenant: str, ref: LayerRef) -> Layer | None:
        """The layer's record from the first plugin that answers (its NotFound raised), or
        None if none does."""
        return await _await_me_maybe(self.pm.hook.dsec_layer_resolve(tenant=tenant, ref=ref))

    def observes_layer_reads(self) -> bool:
        """Whether any plugin implements ``dsec_layer_read`` (measuring reads costs)."""
        return bool(self.pm.hook.dsec_layer_read.get_hookimpls())

    async def layer_read(self, node: str, digest: str, sandbox_id: str, bytes_read: int) -> None:
        await self._notify(
            self.pm.hook.dsec_layer_read,
            node=node,
            digest=digest,
            sandbox_id=sandbox_id,
            bytes_read=bytes_read,
        )

    # -- guards ------------------------------------------------------------------------------

    async def guard_exec(self, sandbox: SandboxInfo, request: ExecRequest) -> str | None:
        """The first refusal reason any guard gives, or None."""
        for reason in self.pm.hook.dsec_guard_exec(sandbox=sandbox, request=request):
            reason = await _await_me_maybe(reason)
            if reason:
                return str(reason)
        return None

    def guard_syscalls(self, backend: str) -> list[str]:
        merged: set[str] = set()
        for names in self.pm.hook.dsec_guard_syscalls(backend=backend):
            merged.update(names or ())
        return sorted(merged)

    async def guard_event(self, sandbox_id: str, kind: str, detail: dict[str, Any]) -> None:
        await self._notify(
            self.pm.hook.dsec_guard_event, sandbox_id=sandbox_id, kind=kind, detail=detail
        )

    # -- helpers -----------------------------------------------------------------------------

    async def _notify(self, hook: Any, **kwargs: Any) -> None:
        """Call a notification hook's every implementation, each on its own: one plugin's
        exception is logged with its name and never keeps the others from being told
        (pluggy's own call stops at the first that raises)."""
        for impl in reversed(hook.get_hookimpls()):  # pluggy's order: last registered first
            try:
                await _await_me_maybe(impl.function(*(kwargs[a] for a in impl.argnames)))
            except Exception:
                log.exception("hook %s of plugin %s failed", hook.name, impl.plugin_name)
