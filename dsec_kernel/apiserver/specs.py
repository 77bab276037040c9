"""A sandbox spec checked before it reaches a node: its backend (the cluster's default when
it names none), its job, what the backend must be able to do for it, and its layers."""

from __future__ import annotations

from dsec_kernel.apiserver.leases import JobLookup
from dsec_kernel.apiserver.nodes import Nodes
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import SandboxSpec
from dsec_kernel.layercheck import check_layers

__all__ = ["Specs"]


class Specs:
    """Checks of a spec against the nodes (``nodes``), the tenant's jobs (``job``) and the
    layer stores the plugins answer for (``hooks``)."""

    def __init__(self, settings: ApiSettings, nodes: Nodes, job: JobLookup, hooks: Hooks) -> None:
        self.settings = settings
        self.nodes = nodes
        self.job = job
        self.hooks = hooks

    async def check_layers(self, tenant: str, spec: SandboxSpec) -> None:
        """NotFound naming every layer of ``spec`` that ``tenant`` cannot use, before any
        placement (:func:`~dsec_kernel.layercheck.check_layers`)."""
        await check_layers(self.hooks, tenant, spec)

    def with_backend(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with the cluster's default backend if it names none (InvalidArgument when
        the operator set no default)."""
        if spec.backend is not None:
            return spec
        if self.settings.default_backend is None:
            known = self.nodes.backends()
            raise errors.InvalidArgument(
                "name a backend: this cluster has no default (DSEC_DEFAULT_BACKEND of its "
                f"apiservers; `dsec up` sets it); it runs {', '.join(known) or 'none yet'}"
            )
        return spec.model_copy(update={"backend": self.settings.default_backend})

    def check(self, tenant: str, spec: SandboxSpec) -> None:
        """Raise the typed error a create of ``spec`` would meet before reaching a node."""
        backend = spec.backend
        views = self.nodes.views.values()
        if not any(v.info.backend(backend) for v in views):
            known = self.nodes.backends()
            raise errors.UnknownBackend(
                f"no node runs backend {backend!r}; backends in this cluster: "
                f"{', '.join(known) or 'none (is an edge running?)'}"
            )
        if spec.job:
            job = self.job(tenant, spec.job)
            if job is None:
                raise errors.InvalidArgument(
                    f"no job {spec.job!r}: open it first (`async with client.job(...)`)"
                )
            if job.state != "active":
                raise errors.SandboxPaused(
                    f"job {spec.job!r}: its lease lapsed; renew it before creating more"
                )
        if spec.snapshot and not any(
            (b := v.info.backend(backend)) and b.capabilities.fork for v in views
        ):
            raise errors.Unsupported(
                f"backend {backend!r} cannot start sandboxes from a snapshot (no fork capability)"
            )
