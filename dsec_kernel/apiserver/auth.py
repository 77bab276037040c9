"""Who a request comes from: the tenant its token belongs to (KV ``dsec-tenants``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.state.buckets import TENANTS
from dsec_kernel.state.facade import ClusterState
from dsec_kernel.state.tenants import tenant_of

__all__ = ["Auth", "Authenticate"]

#: ``authenticate(req)``: the tenant a request comes from (:meth:`Auth.tenant`)
Authenticate = Callable[[bus.Request], Awaitable[str]]


class Auth:
    """Tenants by token, from a mirror of the tenants bucket (:attr:`tenants`)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.tenants = state.mirror(TENANTS, tenant_of)

    async def tenant(self, req: bus.Request) -> str:
        """The tenant whose token the request carries (Unauthenticated if none). Its answer
        can only go to that token's own inbox: others were dropped (bus.replies_to_caller)."""
        token = (req.headers or {}).get(bus.TOKEN_HEADER)
        tenant = self.tenants.get(bus.token_key(token)) if token else None
        if tenant is None and token:  # a tenant created a moment ago, not yet mirrored
            with suppress(Exception):
                tenant = await self.state.tenant(token)
        if tenant is None:
            raise errors.Unauthenticated(
                "missing or unknown credential: pass token= / set DSEC_TOKEN, or use the "
                "connection file that `dsec up` writes"
            )
        return tenant
