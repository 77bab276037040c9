"""The DSec SDK (re-exported from ``dsec_kernel``)."""

from dsec_kernel.sdk.client import AsyncClient
from dsec_kernel.sdk.job import Job
from dsec_kernel.sdk.pool import Pool
from dsec_kernel.sdk.results import BatchEntry, DestroyReport, NotCreated, check
from dsec_kernel.sdk.sandbox import Sandbox, Snapshot
from dsec_kernel.sdk.sync import Client, SyncJob, SyncPool, SyncSandbox

__all__ = [
    "AsyncClient",
    "BatchEntry",
    "Client",
    "DestroyReport",
    "Job",
    "NotCreated",
    "Pool",
    "Sandbox",
    "Snapshot",
    "SyncJob",
    "SyncPool",
    "SyncSandbox",
    "check",
]
