"""Hook specifications: where plugins observe or contribute to the kernel's work.

Drivers (a backend, the layer store, the placement policy) are *selected* by name through
stevedore (:mod:`dsec_kernel.loader`); hooks are for the places where *many* plugins
take part. A plugin implements hooks with ``@dsec_kernel.hookimpl`` on an object it registers
under the ``dsec.guards`` entry-point group (or any group: every loaded plugin object is
registered). Kernel code never calls ``pm.hook.*`` directly; it goes through the typed
facade :class:`dsec_kernel.contract.hooks.Hooks`.

Hooks are synchronous. One that needs I/O may return an awaitable; the facade awaits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from dsec_kernel.contract.placement import NodeView, PlacementRequest
    from dsec_kernel.contract.wire import ExecRequest, NodeInfo, SandboxInfo

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
def dsec_layer_resolve(name: str, version: str, kind: str) -> dict[str, Any] | None:
    """Resolve a layer reference ``name:version`` of ``kind`` (``base``, ``workspace`` or
    ``toolkit``) to the layer's record (at least ``digest`` and ``size``).

    First result wins; ``None`` means "not mine / not found". The kernel raises NotFound when
    no plugin resolves a layer a sandbox asks for.
    """


@hookspec
def dsec_layer_read(node: str, digest: str, sandbox_id: str, bytes_read: int) -> None:
    """A layer store reports how many bytes of layer ``digest`` a sandbox read on ``node``.

    Lets any plugin (metrics, placement locality) observe on-demand reads. Return ignored.
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
