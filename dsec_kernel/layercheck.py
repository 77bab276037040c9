"""The apiserver's check that a create's layers exist, before any of its sandboxes is placed.

The layers are resolved through the ``dsec_layer_resolve`` hook, which the layer store the
apiserver is configured with answers (:func:`layer_store_plugins` gives it to the apiserver's
hooks). A layer no plugin answers for is not checked here: the node's backend resolves it
when it makes the sandbox.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from dsec_kernel.config import StorageSettings
from dsec_kernel.contract.errors import NotFound
from dsec_kernel.loader import discover, open_store

if TYPE_CHECKING:
    from dsec_kernel.contract.hooks import Hooks
    from dsec_kernel.contract.store import LayerStore
    from dsec_kernel.contract.wire.sandbox import LayerRef, SandboxSpec

__all__ = ["check_layers", "layer_store_plugins"]


async def check_layers(hooks: Hooks, tenant: str, spec: SandboxSpec) -> None:
    """Raise NotFound naming every layer of ``spec``'s env that ``tenant`` cannot use (each
    in its store's words), if any plugin says so; return if all were found, or not answered
    for. A spec that starts from a snapshot is made of the snapshot's layers, not its env's:
    nothing to check. Other errors of a plugin are raised as they are."""
    if spec.env is None or spec.snapshot is not None:
        return
    refs = list(dict.fromkeys(spec.env.refs()))  # a toolkit named twice is looked up once
    missing = [m for m in await asyncio.gather(*(_missing(hooks, tenant, r) for r in refs)) if m]
    if len(missing) == 1:
        raise NotFound(missing[0])
    if missing:
        each = " ".join(f"({i}) {m}" for i, m in enumerate(missing, 1))
        raise NotFound(f"{len(missing)} layers of the env are missing: {each}")


async def _missing(hooks: Hooks, tenant: str, ref: LayerRef) -> str | None:
    """Why ``ref`` is not found, or None if it is (or no plugin knows)."""
    try:
        await hooks.layer_resolve(tenant, ref)
    except NotFound as exc:
        return exc.message
    return None


def layer_store_plugins() -> list[LayerStore]:
    """The layer store of this process's configuration (``DSEC_STORAGE``,
    ``DSEC_STORAGE_CONFIG__*``; under ``dsec up`` the one its nodes use, in its state dir),
    to register with the apiserver's hooks; none when no storage plugin is installed and
    none is named. PluginLoadError for a named, broken or misconfigured one."""
    if StorageSettings().storage is None and not discover("dsec.storage"):
        return []
    return [open_store()]
