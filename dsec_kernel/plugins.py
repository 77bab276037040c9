"""Plugin discovery (stevedore) and the typed facade over hooks (pluggy).

Five entry-point groups: ``dsec.backends``, ``dsec.storage``, ``dsec.placement``,
``dsec.guards`` and ``dsec.recipes`` (the layers ``dsec layer build`` makes). Drivers named in
configuration are loaded with :func:`load_drivers`; a missing or broken one raises
:class:`PluginLoadError` naming it and the reason, at start-up. Every loaded plugin object is
registered with pluggy, so any of them may implement hooks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy
from stevedore import ExtensionManager, NamedExtensionManager

from dsec_kernel import hookspecs

if TYPE_CHECKING:
    from dsec_kernel.placement import NodeView, PlacementRequest
    from dsec_kernel.wire import ExecRequest, NodeInfo, SandboxInfo

__all__ = [
    "GROUPS",
    "Hooks",
    "PluginInfo",
    "PluginLoadError",
    "discover",
    "hookimpl",
    "load_drivers",
]

log = logging.getLogger(__name__)

GROUPS = ("dsec.backends", "dsec.storage", "dsec.placement", "dsec.guards", "dsec.recipes")
hookimpl = pluggy.HookimplMarker("dsec")


class PluginLoadError(RuntimeError):
    """A plugin named in configuration is missing or cannot be loaded."""


@dataclass
class PluginInfo:
    """One entry point as discovered: where it comes from and whether it loads."""

    group: str
    name: str
    target: str
    distribution: str = ""
    version: str = ""
    obj: Any = None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def _dist_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else ("", "")


def discover(group: str) -> list[PluginInfo]:
    """Every entry point of ``group``, loaded, with the load error of those that fail."""
    found: list[PluginInfo] = []
    failures: dict[str, str] = {}

    def on_failure(_mgr: Any, ep: metadata.EntryPoint, exc: BaseException) -> None:
        failures[ep.name] = f"{type(exc).__name__}: {exc}"

    mgr = ExtensionManager(
        namespace=group, invoke_on_load=False, on_load_failure_callback=on_failure
    )
    loaded = {ext.name: ext for ext in mgr.extensions}
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        dist, version = _dist_of(ep)
        ext = loaded.get(ep.name)
        found.append(
            PluginInfo(
                group=group,
                name=ep.name,
                target=ep.value,
                distribution=dist,
                version=version,
                obj=ext.plugin if ext else None,
                error=None if ext else failures.get(ep.name, "not loaded (duplicate name?)"),
            )
        )
    return found


def load_drivers(group: str, names: Iterable[str]) -> dict[str, PluginInfo]:
    """Load the named drivers of ``group``, in the given order.

    Raises :class:`PluginLoadError` for the first name that has no entry point or whose
    entry point fails to import, listing the names that are available.
    """
    names = list(dict.fromkeys(names))
    if not names:
        return {}
    failures: dict[str, str] = {}

    def on_failure(_mgr: Any, ep: metadata.EntryPoint, exc: BaseException) -> None:
        failures[ep.name] = f"{type(exc).__name__}: {exc}"

    def on_missing(missing: set[str]) -> None:  # also called for those that failed to load
        for n in missing:
            failures.setdefault(n, "no such plugin is installed")

    mgr = NamedExtensionManager(
        namespace=group,
        names=names,
        name_order=True,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
        on_missing_entrypoints_callback=on_missing,
    )
    for name in names:
        if name in failures:
            available = ", ".join(sorted(ep.name for ep in metadata.entry_points(group=group)))
            raise PluginLoadError(
                f"{group} plugin {name!r} cannot be loaded: {failures[name]} "
                f"(installed: {available or 'none'}; `dsec plugins` lists them)"
            )
    eps = {ep.name: ep for ep in metadata.entry_points(group=group)}
    out: dict[str, PluginInfo] = {}
    for ext in mgr.extensions:
        dist, version = _dist_of(eps[ext.name])
        out[ext.name] = PluginInfo(
            group=group,
            name=ext.name,
            target=eps[ext.name].value,
            distribution=dist,
            version=version,
            obj=ext.plugin,
        )
    return out


async def _await_me_maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Hooks:
    """The typed facade: the only way kernel code calls hooks.

    Build it with :meth:`load`, which registers the given plugin objects and checks that
    every ``dsec_*`` method they define is a known hook (a misspelt hook fails at start-up).
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm

    @classmethod
    def load(cls, plugins: Iterable[object] = (), guards: Iterable[str] | None = None) -> Hooks:
        """Register ``plugins`` and the guards named in ``guards`` (all installed when None)."""
        pm = pluggy.PluginManager("dsec")
        pm.add_hookspecs(hookspecs)
        if guards is None:
            found = discover("dsec.guards")
            for p in found:
                if p.error is not None:
                    log.warning("guard plugin %s is broken and not loaded: %s", p.name, p.error)
            guard_objs = [p.obj for p in found if p.error is None]
        else:
            guard_objs = [p.obj for p in load_drivers("dsec.guards", guards).values()]
        for obj in [*guard_objs, *plugins]:
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

    async def layer_resolve(self, name: str, version: str, kind: str) -> dict[str, Any] | None:
        return await _await_me_maybe(
            self.pm.hook.dsec_layer_resolve(name=name, version=version, kind=kind)
        )

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
