"""Hook specifications: where plugins observe or contribute to the kernel's work.

Drivers (a backend, the layer store, the placement policy) are *selected* by name through
stevedore (:mod:`dsec_kernel.loader`); hooks are for the places where *many* plugins take
part. A plugin implements hooks with ``@dsec_kernel.hookimpl`` on an object it registers under
the ``dsec.guards`` entry-point group (every process registers the guards it is configured
with, all installed ones by default), or on a driver that the process registers: an edge's
backends, an apiserver's layer store. Kernel code never calls ``pm.hook.*`` directly; it goes
through the typed facade :class:`dsec_kernel.contract.hooks.Hooks`.

Hooks are synchronous. One that needs I/O may return an awaitable; the facade awaits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from dsec_kernel.contract.placement import NodeView, PlacementRequest
    from dsec_kernel.contract.store import Layer
    from dsec_kernel.contract.wire import ExecRequest, NodeInfo, SandboxInfo
    from dsec_kernel.contract.wire.sandbox import LayerRef

hookspec = pluggy.HookspecMarker("dsec")
hookimpl = pluggy.HookimplMarker("dsec")  # what a plugin marks its implementations with

# -------------------------------------------------------------------------------------------
# lifecycle
# -------------------------------------------------------------------------------------------


@hookspec(historic=True)
def dsec_configure(role: str, node: str | None) -> None:
    """A DSec process started.

    :param role: ``"apiserver"`` or ``"edge"``.
    :param node: the node name for an edge, ``None`` for an apiserver.

    Historic: a plugin registered later is called too. Return value ignored.
    """


@hookspec
def dsec_sandbox_created(sandbox: SandboxInfo) -> None:
    """Called on the edge after a sandbox is ready, before the create request is answered.

    :param sandbox: its record as it will be stored.

    Return value ignored; an exception is logged and does not undo the creation.
    """


@hookspec
def dsec_sandbox_destroyed(sandbox: SandboxInfo, reason: str) -> None:
    """Called on the edge after a sandbox's resources are released.

    :param sandbox: its last record.
    :param reason: ``"requested"``, ``"ttl"``, ``"reconcile"`` (found on the node but not in
        the cluster state, or reported lost) or ``"failed"`` (its creation was rolled back).

    Return value ignored.
    """


@hookspec
def dsec_node_down(node: NodeInfo, lost: list[str]) -> None:
    """Called on the apiserver that marked a node down because its heartbeats stopped.

    :param node: the node's record, already ``state="down"``.
    :param lost: ids of the sandboxes that were on it, now reported ``lost``.
    """


# -------------------------------------------------------------------------------------------
# placement
# -------------------------------------------------------------------------------------------


@hookspec
def dsec_placement_filter(node: NodeView, request: PlacementRequest) -> bool | None:
    """May ``node`` take sandboxes of ``request`` at all?

    Called by the placement policy for every candidate node that runs the backend and has
    room. Return ``False`` to exclude the node; ``True`` or ``None`` has no effect.
    """


@hookspec
def dsec_placement_score(node: NodeView, request: PlacementRequest) -> float | None:
    """Extra score for placing ``request`` on ``node`` (higher is better).

    The policy adds every plugin's number to its own score, so a plugin can prefer nodes
    (layer cache locality, an operator's label) without replacing the policy. ``None``: no
    opinion.
    """


# -------------------------------------------------------------------------------------------
# storage
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def dsec_layer_resolve(tenant: str, ref: LayerRef) -> Layer | Awaitable[Layer] | None:
    """Called on the apiserver for each layer of a create's or a warm pool's env (unless
    its sandboxes start from a snapshot), before any of them is placed
    (:func:`dsec_kernel.layercheck.check_layers`).

    :param tenant: who asks; the layer as it sees the store (a public layer first, then its
        own).
    :param ref: the layer, with the kind of its place in the env.

    Return the layer's record (or an awaitable of it), or raise
    :class:`~dsec_kernel.contract.errors.NotFound` if the store has no such layer for
    ``tenant`` (in words that say nothing of other tenants' layers): the create then fails
    with one NotFound naming every missing layer of its env. ``None``: not this plugin's to
    say. First result wins.

    The apiserver registers the layer store of its configuration (``DSEC_STORAGE``,
    ``DSEC_STORAGE_CONFIG__*``) when a storage plugin is installed with it, so a store
    answers by implementing this hook. When no plugin answers, the layer is not checked
    there: the backend of the node the sandbox is placed on resolves it when it makes the
    sandbox (and that create fails with NotFound for the first missing layer).
    """


@hookspec
def dsec_layer_read(node: str, digest: str, sandbox_id: str, bytes_read: int) -> None:
    """Called on the edge after a sandbox made of layers is destroyed, once for each layer
    image it used, by the backend that mounted them from the layer store (``container``).

    :param node: the node the sandbox ran on.
    :param digest: the layer's image.
    :param sandbox_id: the sandbox.
    :param bytes_read: how much of the image ``node`` had read when the sandbox let go of
        it, as the store measures it (:meth:`~dsec_kernel.contract.store.LayerStore.usage`:
        the image's pages in the node's page cache). A node's sandboxes share one mount of
        each image, so this counts what all of them read there, less what the kernel
        evicted since.

    Lets a metrics or locality plugin observe on-demand reads. Measuring walks the mounted
    image, so a backend measures (and calls this) only while some plugin implements it.
    Return value ignored.
    """


# -------------------------------------------------------------------------------------------
# guards
# -------------------------------------------------------------------------------------------


@hookspec
def dsec_guard_exec(sandbox: SandboxInfo, request: ExecRequest) -> str | None:
    """Called on the edge before a command runs in ``sandbox``.

    Return a reason (a string) to refuse it: the caller gets a ``forbidden`` error with that
    reason and the command does not run. ``None`` lets it run.
    """


@hookspec
def dsec_guard_syscalls(backend: str) -> list[str] | None:
    """Extra system calls to refuse (``EPERM``) in sandboxes of ``backend``.

    Called once when a backend that filters system calls (seccomp) starts; the lists of all
    plugins are merged with the backend's own. Names are libseccomp's (``"ptrace"``).
    """


@hookspec
def dsec_guard_event(sandbox_id: str, kind: str, detail: dict[str, Any]) -> None:
    """A guard or detector saw misbehaviour (``kind`` e.g. ``"timeout"``, ``"output_flood"``).

    Notification for every plugin that records or reacts; return ignored.
    """
