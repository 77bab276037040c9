"""The reaper: sandboxes past their TTL are destroyed."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.contract.wire import DestroyResponse, SandboxInfo

__all__ = ["Reaper"]

log = logging.getLogger(__name__)


class Reaper:
    """Its periodic :meth:`reap` destroys (``destroy``) what the registry finds expired."""

    def __init__(
        self,
        registry: Registry,
        destroy: Callable[[list[SandboxInfo]], Awaitable[DestroyResponse]],
    ) -> None:
        self.registry = registry
        self.destroy = destroy

    async def reap(self) -> None:
        """Destroy sandboxes past their TTL; those whose edge did not answer are tried
        again at a later round."""
        now = time.time()
        expired = self.registry.expired(now)
        if expired:
            log.info("destroying %d sandbox(es) past their ttl", len(expired))
            try:
                await self.destroy(expired)
            finally:
                self.registry.expire_again(expired, now)
