"""Plugin discovery and loading: the one place the kernel turns a configured name into a
driver (stevedore over entry points).

Five entry-point groups: ``dsec.backends``, ``dsec.storage``, ``dsec.placement``,
``dsec.guards`` and ``dsec.recipes`` (the layers ``dsec layer build`` makes). A driver named in
configuration is loaded with :func:`load_driver` (its ``Config`` validated) or
:func:`load_drivers`; a missing, broken or misconfigured one raises :class:`PluginLoadError`
naming it and the reason, at start-up. Guards are registered with pluggy by
:func:`load_hooks`, as are the objects it is given (an edge's backends, the apiserver's layer
store), so those may implement hooks; a placement policy reaches the placement hooks through
what it is given (:class:`~dsec_kernel.contract.placement.PlacementHooks`) and implements none.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from stevedore import ExtensionManager, NamedExtensionManager

from dsec_kernel.contract.hooks import Hooks

if TYPE_CHECKING:
    from pathlib import Path

    from dsec_kernel.contract.store import LayerStore

__all__ = [
    "GROUPS",
    "PluginInfo",
    "PluginLoadError",
    "discover",
    "load_driver",
    "load_drivers",
    "load_hooks",
    "open_store",
]

log = logging.getLogger(__name__)

GROUPS = ("dsec.backends", "dsec.storage", "dsec.placement", "dsec.guards", "dsec.recipes")
# the setting that names the driver of a group when the operator chooses
SETTING = {
    "dsec.backends": "DSEC_DEFAULT_BACKEND",
    "dsec.storage": "DSEC_STORAGE",
    "dsec.placement": "DSEC_PLACEMENT",
}


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


def load_hooks(
    plugins: Iterable[object] = (),
    guards: Iterable[str] | None = None,
    guard_config: dict[str, dict[str, Any]] | None = None,
) -> Hooks:
    """The hooks facade with ``plugins`` and the guards named in ``guards`` registered (every
    installed guard when None; a broken one is then logged and left out). A guard that is a
    class is made with its ``Config`` validated from ``guard_config[name]`` (PluginLoadError
    if it does not validate, or configuration names a guard not loaded)."""
    if guards is None:
        found = discover("dsec.guards")
        for p in found:
            if p.error is not None:
                log.warning("guard plugin %s is broken and not loaded: %s", p.name, p.error)
        loaded = {p.name: p.obj for p in found if p.error is None}
    else:
        loaded = {n: p.obj for n, p in load_drivers("dsec.guards", guards).items()}
    config = guard_config or {}
    if unknown := sorted(set(config) - set(loaded)):
        raise PluginLoadError(f"configuration given for guard(s) not loaded: {unknown}")
    objs = []
    for name, obj in loaded.items():
        if inspect.isclass(obj):
            cfg = configured("guard", name, obj, config.get(name))
            obj = obj() if cfg is None else obj(cfg)
        objs.append(obj)
    return Hooks.of([*objs, *plugins])


def configured(kind: str, name: str, cls: Any, config: dict[str, Any] | None) -> Any:
    """``cls.Config`` validated from ``config`` (a driver without ``Config`` takes none);
    PluginLoadError naming the ``kind`` and ``name`` if it does not validate."""
    from dsec_kernel.bus import validation_message

    model = getattr(cls, "Config", None)
    if model is None:
        if config:
            raise PluginLoadError(f"{kind} {name!r} takes no configuration, yet was given some")
        return None
    try:
        return model.model_validate(config or {})
    except ValidationError as exc:
        raise PluginLoadError(
            f"{kind} {name!r} configuration is invalid: {validation_message(exc)}"
        ) from None


def load_driver(
    group: str, name: str | None, config: dict[str, Any] | None = None, *args: Any
) -> Any:
    """The driver ``name`` of ``group`` (None: the :func:`preferred` one) made with its
    validated ``Config``: ``cls(cls.Config(**config), *args)``. PluginLoadError if it is
    missing, broken or misconfigured."""
    name = name or preferred(group)
    cls = load_drivers(group, [name])[name].obj
    kind = group.removeprefix("dsec.").rstrip("s")
    return cls(configured(kind, name, cls, config), *args)


def default_backend(named: Iterable[str] | None = None) -> str:
    """What ``dsec up`` makes the cluster's default backend: ``DSEC_DEFAULT_BACKEND`` if set,
    else the :func:`preferred` of the backends an edge runs (``named``, or every installed
    one enabled by default that this machine can run)."""
    if chosen := os.environ.get("DSEC_DEFAULT_BACKEND"):
        return chosen
    if named is None:
        named = [
            p.name
            for p in discover("dsec.backends")
            if p.error is None and p.obj.default_enabled and not p.obj.unavailable_reason()
        ]
    return preferred("dsec.backends", among=named)


def preferred(group: str, among: Iterable[str] | None = None) -> str:
    """The plugin of ``group`` (of those named in ``among``, if given) that loads and has the
    lowest ``preference`` its class declares (100 unless it says): what runs when the
    operator names none. The kernel itself prefers no plugin. PluginLoadError when none
    loads, or two tie."""
    allowed = None if among is None else set(among)
    ranked = sorted(
        (getattr(p.obj, "preference", 100), p.name)
        for p in discover(group)
        if p.error is None and (allowed is None or p.name in allowed)
    )
    setting = SETTING.get(group, group)
    if not ranked:
        raise PluginLoadError(f"no {group} plugin is installed that loads; `dsec plugins` says why")
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        raise PluginLoadError(
            f"{ranked[0][1]!r} and {ranked[1][1]!r} are equally preferred {group} plugins: "
            f"name one ({setting})"
        )
    return ranked[0][1]


def open_store(
    name: str | None = None, config: dict | None = None, state_dir: Path | None = None
) -> LayerStore:
    """The configured layer store (``DSEC_STORAGE``, ``DSEC_STORAGE_CONFIG__*``; unnamed: the
    :func:`preferred`), or the one given; for a node's edge whose state is in ``state_dir``,
    with the store's :meth:`~dsec_kernel.contract.store.LayerStore.node_defaults` under the
    configuration. A missing or broken driver, or a bad configuration, raises
    PluginLoadError."""
    from dsec_kernel.config import StorageSettings

    settings = StorageSettings()
    name = name or settings.storage or preferred("dsec.storage")
    cls = load_drivers("dsec.storage", [name])[name].obj
    given = dict(config if config is not None else settings.storage_config)
    if state_dir is not None:
        given = {**cls.node_defaults(state_dir), **given}
    return cls(configured("storage", name, cls, given))
