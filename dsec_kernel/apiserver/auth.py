"""Who a request comes from: the tenant its credential belongs to (KV ``dsec-tenants``)."""

from __future__ import annotations

from contextlib import suppress

from dsec_kernel.state.buckets import TENANTS
from dsec_kernel.state.facade import ClusterState
from dsec_kernel.state.tenants import tenant_of

__all__ = ["Auth"]


class Auth:
    """Tenants by credential key, from a mirror of the tenants bucket (:attr:`tenants`)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.tenants = state.mirror(TENANTS, tenant_of)

    async def tenant(self, key: str) -> str | None:
        """The tenant of the credential stored under ``key`` (``bus.token_key`` of the token
        a request carries), or None: the :data:`bus.Authenticate` the apiserver serves
        with. The request's answer can only go to that token's own inbox: others were
        dropped (``bus.replies_to_caller``)."""
        tenant = self.tenants.get(key)
        if tenant is None:  # a tenant created a moment ago, not yet mirrored
            with suppress(Exception):
                tenant = await self.state.tenant(key)
        return tenant
