"""DSec: elastic sandboxes for agentic reinforcement learning.

``import dsec_kernel as dsec`` gives the SDK::

    async with dsec.AsyncClient() as c:
        sbs = await c.create(count=8, ttl=600)  # on the cluster's default backend
        results = await c.exec_many(sbs, "echo hi", timeout=10)

The same package holds the kernel (wire models, hooks, plugins, bus, apiserver, edge) that
plugins build on; see docs/architecture.md. Names are imported on first use, so importing a
small module such as :mod:`dsec_kernel.linuxhost.syscalls` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncClient": "dsec_kernel.sdk",
    "Client": "dsec_kernel.sdk",
    "Sandbox": "dsec_kernel.sdk",
    "SyncSandbox": "dsec_kernel.sdk",
    "Snapshot": "dsec_kernel.sdk",
    "Job": "dsec_kernel.sdk",
    "Pool": "dsec_kernel.sdk",
    "DestroyReport": "dsec_kernel.sdk",
    "NotCreated": "dsec_kernel.sdk",
    "check": "dsec_kernel.sdk",
    "build_toolkit": "dsec_kernel.sdk.toolkits",
    "PauseReport": "dsec_kernel.contract.wire",
    "Env": "dsec_kernel.contract.wire",
    "LayerRef": "dsec_kernel.contract.wire",
    "FsDiff": "dsec_kernel.contract.wire",
    "ExecResult": "dsec_kernel.contract.wire",
    "Limits": "dsec_kernel.contract.wire",
    "NodeInfo": "dsec_kernel.contract.wire",
    "SandboxInfo": "dsec_kernel.contract.wire",
    "hookimpl": "dsec_kernel.contract.hookspecs",
    **{
        name: "dsec_kernel.contract.errors"
        for name in (
            "CapacityExceeded",
            "Conflict",
            "DeadlineExceeded",
            "DsecError",
            "Forbidden",
            "Internal",
            "InvalidArgument",
            "NotFound",
            "QueueFull",
            "QuotaExceeded",
            "SandboxLost",
            "SandboxPaused",
            "Unauthenticated",
            "Unavailable",
            "UnknownBackend",
            "Unsupported",
        )
    },
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsec_kernel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from dsec_kernel.contract.errors import (
        CapacityExceeded,
        Conflict,
        DeadlineExceeded,
        DsecError,
        Forbidden,
        Internal,
        InvalidArgument,
        NotFound,
        QueueFull,
        QuotaExceeded,
        SandboxLost,
        SandboxPaused,
        Unauthenticated,
        Unavailable,
        UnknownBackend,
        Unsupported,
    )
    from dsec_kernel.contract.hookspecs import hookimpl
    from dsec_kernel.contract.wire import (
        Env,
        ExecResult,
        FsDiff,
        LayerRef,
        Limits,
        NodeInfo,
        PauseReport,
        SandboxInfo,
    )
    from dsec_kernel.sdk import (
        AsyncClient,
        Client,
        DestroyReport,
        Job,
        NotCreated,
        Pool,
        Sandbox,
        Snapshot,
        SyncSandbox,
        check,
    )
    from dsec_kernel.sdk.toolkits import build_toolkit
