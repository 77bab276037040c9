"""Which backends a node runs, and what its edge says of them."""

from __future__ import annotations

import logging
from importlib import metadata

from dsec_kernel.config import EdgeSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend
from dsec_kernel.contract.wire import BackendInfo
from dsec_kernel.loader import PluginLoadError, configured, discover, load_drivers

__all__ = ["backend_infos", "load_backends", "named"]

log = logging.getLogger(__name__)


def load_backends(settings: EdgeSettings) -> tuple[dict[str, Backend], dict[str, str]]:
    """Instantiate the node's backends; returns (backends, {skipped name: reason}).

    With ``settings.backends`` unset, every installed backend this machine can run is used and
    the others are skipped with their reason. A backend named explicitly that is missing,
    broken, misconfigured or cannot run here raises :class:`PluginLoadError`.
    """
    skipped: dict[str, str] = {}
    if settings.backends is None:
        classes = {}
        for p in discover("dsec.backends"):
            if p.error:
                skipped[p.name] = f"plugin does not load: {p.error}"
            elif not p.obj.default_enabled:
                skipped[p.name] = "runs only when named in --backends / DSEC_BACKENDS"
            else:
                classes[p.name] = p.obj
    else:
        classes = {n: p.obj for n, p in load_drivers("dsec.backends", settings.backends).items()}
    backends: dict[str, Backend] = {}
    for name, cls in classes.items():
        reason = cls.unavailable_reason()
        if reason:
            if settings.backends is not None:
                raise PluginLoadError(f"backend {name!r} cannot run on this machine: {reason}")
            skipped[name] = reason
            continue
        backends[name] = cls(configured("backend", name, cls, settings.backend_config.get(name)))
    installed = {p.name for p in discover("dsec.backends")}
    unknown = set(settings.backend_config) - installed
    if unknown:
        raise PluginLoadError(
            f"configuration given for backend(s) no installed plugin has: {sorted(unknown)}; "
            "`dsec plugins` lists them"
        )
    for name in sorted(set(settings.backend_config) & installed - set(classes)):
        log.info("configuration for backend %s is unused: it does not run here", name)
    return backends, skipped


def named(backends: dict[str, Backend], name: str, node: str) -> Backend:
    """The backend called ``name``; UnknownBackend if ``node`` does not run it."""
    try:
        return backends[name]
    except KeyError:
        raise errors.UnknownBackend(f"node {node} does not run backend {name!r}") from None


def backend_infos(backends: dict[str, Backend]) -> list[BackendInfo]:
    """What the node's record says of each backend: name, version, capabilities."""
    return [
        BackendInfo(name=n, version=_plugin_version(b), capabilities=b.capabilities)
        for n, b in backends.items()
    ]


def _plugin_version(backend: Backend) -> str:
    module = type(backend).__module__.split(".")[0]
    try:
        return metadata.version(metadata.packages_distributions().get(module, [module])[0])
    except (metadata.PackageNotFoundError, IndexError):
        return ""
