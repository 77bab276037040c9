"""The project's own attack suite: a hostile tenant against real sandboxes of every backend.

Every test plays an attacker with public means only (the SDK, a NATS connection with its own
credential, what runs inside its sandbox) against a victim tenant, and asserts the attack
fails and the host, NATS and the victim are untouched. Each attempt is recorded with the
``attack`` fixture (``attack(name, backend, outcome)``) and the session ends with a table.

The platform is one set of real processes for the whole suite (nats-server, an apiserver and
an edge running every backend this machine can, on a layer store with the busybox base);
tests that must kill or restart pieces start their own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

import dsec_kernel as dsec
from dsec_kernel.cluster import LocalCluster
from dsec_kernel.connection import Connection

BUSYBOX = dsec.Env(base="busybox:1")
_TABLE: list[tuple[str, str, str]] = []


@pytest.fixture
def attack():
    """``attack(name, backend, outcome)`` records one attempt for the closing table
    (``outcome``: how it was stopped)."""

    def record(name: str, backend: str, outcome: str) -> None:
        _TABLE.append((name, backend, outcome))

    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TABLE:
        return
    w = [max(len(row[i]) for row in [*_TABLE, ("attack", "backend", "outcome")]) for i in (0, 1)]
    terminalreporter.section("attacks")
    terminalreporter.write_line(f"{'attack':<{w[0]}}  {'backend':<{w[1]}}  outcome")
    for name, backend, outcome in _TABLE:
        terminalreporter.write_line(f"{name:<{w[0]}}  {backend:<{w[1]}}  {outcome}")


@dataclass
class Platform:
    cluster: LocalCluster
    victim: Connection
    attacker: Connection
    backends: list[str]
    store: Path  # the layer store's root (snapshots live in it)

    def client(self, who: Connection) -> dsec.AsyncClient:
        return dsec.AsyncClient(url=who.url, token=who.token)


@pytest.fixture(scope="session")
def platform(tmp_path_factory):
    """nats-server + apiserver + one edge (every backend that runs here), tenants ``victim``
    and ``attacker``."""
    from dsec_storage_3fs.images import busybox_tree, ensure_layer

    from dsec_kernel.loader import open_store

    root: Path = tmp_path_factory.mktemp("attacks")
    store = {"root": str(root / "store"), "cache_dir": str(root / "cache")}
    ensure_layer(open_store("3fs", store), "base", "busybox", "1", busybox_tree)
    env = {
        "DSEC_STORAGE_CONFIG__ROOT": store["root"],
        "DSEC_BACKEND_CONFIG__CONTAINER__FILE_TIMEOUT_S": "3",  # (stopped helpers, sooner)
        "DSEC_BACKEND_CONFIG__CONTAINER__UPPER_FS_GB": "2",  # (a tenant's share: 1 GiB)
    }
    cluster = LocalCluster(root / "platform", env)
    try:
        cluster.start_nats()
        cluster.start_apiserver()
        cluster.start_edge("node-a")
        nodes = asyncio.run(cluster.ready(90))
        backends = sorted({b.name for n in nodes for b in n.backends})
        victim, attacker = cluster.tenant("victim"), cluster.tenant("attacker")
        yield Platform(cluster, victim, attacker, backends, Path(store["root"]))
    finally:
        cluster.stop()


@pytest_asyncio.fixture
async def victim(platform):
    async with platform.client(platform.victim) as c:
        yield c


@pytest_asyncio.fixture
async def attacker(platform):
    async with platform.client(platform.attacker) as c:
        yield c


@pytest.fixture
def needs(platform):
    """``needs(backend)`` skips the test, with the reason, unless the platform runs it."""

    def check(backend: str) -> None:
        if backend not in platform.backends:
            pytest.skip(f"the {backend} backend does not run on this machine")

    return check
