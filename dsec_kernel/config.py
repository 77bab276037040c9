"""Typed configuration, read from ``DSEC_*`` environment variables and command-line flags.

Nested fields use ``__``: ``DSEC_BACKEND_CONFIG__FNCALL__POOL_SIZE=32`` sets the fncall
backend's ``pool_size``. docs/configuration.md lists every setting.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from dsec_kernel.contract.wire import NAME_PATTERN

__all__ = [
    "ApiSettings",
    "EdgeSettings",
    "StorageSettings",
    "default_node_name",
    "default_state_dir",
]


def default_state_dir() -> Path:
    """``$DSEC_STATE_DIR``, else ``~/.dsec``."""
    return Path(os.environ.get("DSEC_STATE_DIR") or Path.home() / ".dsec")


def default_node_name() -> str:
    """The host name, made safe as a node name."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return name.strip("-_")[:63] or "node"


class _Common(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DSEC_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server(s), comma separated")
    nats_login_file: Path | None = Field(
        None,
        description='the NATS login, a JSON file {"user": ..., "password": ...} (keep it 0600): '
        "processes this one starts inherit its path, not the password",
    )
    nats_credentials: str | None = Field(None, description="NATS .creds file, if required")
    heartbeat_s: float = Field(1.0, gt=0, le=60, description="edge heartbeat interval")
    kv_replicas: int = Field(1, ge=1, le=5, description="copies of each KV bucket")
    guards: list[str] | None = Field(None, description="guard plugins; all installed when unset")
    guard_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-guard configuration, validated by the guard"
    )


class ApiSettings(_Common):
    """Settings of an apiserver process."""

    default_backend: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="the backend of a create that names none (`dsec up` sets it); unset: "
        "such a create is refused",
    )
    placement: str | None = Field(
        None,
        description="the dsec.placement policy; unset: the installed one its plugin prefers",
    )
    placement_config: dict[str, Any] = Field(
        default_factory=dict, description="its configuration, validated by the policy"
    )
    node_timeout_s: float = Field(
        5.0, gt=0, description="a node silent this long is marked down, its sandboxes lost"
    )
    restart_grace_s: float = Field(
        60.0, gt=0, description="the same for a node whose edge stopped on purpose (a restart)"
    )
    edge_timeout_s: float = Field(30.0, gt=0, description="longest wait for an edge's answer")
    lease_check_s: float = Field(0.5, gt=0, description="how often job leases are checked")
    pool_fill_s: float = Field(0.5, gt=0, description="how often warm pools are refilled")
    pools_per_tenant: int = Field(64, ge=1, description="most warm pools one tenant may open")
    queue_per_tenant: int = Field(
        50_000, ge=0, description="most sandboxes of one tenant waiting for room"
    )
    requests_per_credential: int = Field(
        4096, ge=1, description="requests one credential may have in flight (more: queue_full)"
    )
    request_bytes_per_credential: int = Field(
        256 << 20, ge=32 << 20, description="bytes of requests one credential may have in flight"
    )
    protect_s: float = Field(
        60.0, ge=0, description="a sandbox this close to its ttl is never paused for priority"
    )
    priority_ceiling: int = Field(
        0,
        ge=0,
        le=100,
        description="highest priority a tenant's jobs have over other tenants' "
        "work, unless its quota's max_priority says otherwise",
    )
    quota_default_cpus: float = Field(1.0, gt=0, description="quota charge without a CPU limit")
    quota_default_memory_mb: int = Field(
        2048, gt=0, description="quota charge without a memory limit"
    )


class EdgeSettings(_Common):
    """Settings of an edge process (one per node)."""

    node: str = Field(default_factory=default_node_name, pattern=NAME_PATTERN)
    pool: str = Field("default", pattern=NAME_PATTERN, description="node pool label")
    state_dir: Path = Field(default_factory=default_state_dir)
    backends: list[str] | None = Field(
        None, description="backends to run; every installed one this machine can run when unset"
    )
    backend_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-backend configuration, validated by the backend"
    )
    create_concurrency: int = Field(64, ge=1, description="sandboxes created at once per backend")
    reconcile_s: float = Field(60.0, gt=0, description="interval between reconciliations")
    idle_check_s: float = Field(1.0, gt=0, description="how often idle sandboxes are looked for")
    trajectory_mb_per_tenant: int = Field(
        1024, ge=1, description="a tenant's trajectory stream (its oldest entries go first)"
    )
    trajectory_output_bytes: int = Field(
        65536, ge=0, description="stdout and stderr kept per command in the trajectory"
    )


class StorageSettings(BaseSettings):
    """The layer store every process on a node uses (backends, ``dsec layer``)."""

    model_config = SettingsConfigDict(env_prefix="DSEC_", env_nested_delimiter="__", extra="ignore")

    storage: str | None = Field(
        None, description="the dsec.storage driver; unset: the installed one its plugin prefers"
    )
    storage_config: dict[str, Any] = Field(
        default_factory=dict, description="its configuration, e.g. DSEC_STORAGE_CONFIG__ROOT"
    )
