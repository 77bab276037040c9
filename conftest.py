"""Shared test fixtures: real platform processes (nats-server, apiservers, edges) and a leak check.

The session ends by checking that the tests left no DSec or nats-server process, no new
mount and no network namespace behind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dsec_kernel.cgroups import v1_controllers
from dsec_kernel.cluster import LocalCluster

pytest.register_assert_rewrite("dsec_kernel.conformance")  # before any test imports it

_OURS = ("nats-server", "dsec_kernel.cli", "dsec_backend_fncall", "dsec up")


def our_processes() -> dict[int, str]:
    """pid -> command line of every nats-server / DSec process on the machine."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        if any(s in cmd for s in _OURS):
            found[int(pid)] = cmd[:200]
    return found


def netns_entries() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def links_and_swaps() -> set[str]:
    """Network interfaces (bridges, veths) and swap devices."""
    swaps = Path("/proc/swaps").read_text().splitlines()[1:]
    return {*os.listdir("/sys/class/net"), *(line.split()[0] for line in swaps if line)}


def mounts() -> set[str]:
    """Mount points with their source and type (options may change under a test: the
    container backend turns on favordynmods on the cgroup2 mount)."""
    return {
        " ".join(line.split()[:3]) for line in Path("/proc/self/mounts").read_text().splitlines()
    }


def cgroups() -> set[str]:
    """DSec's cgroups below this process's own, in every v1 hierarchy."""
    return {str(p) for d in v1_controllers().values() for p in d.glob("dsec*")}


@pytest.fixture(scope="session", autouse=True)
def hermetic():
    """Tests see no DSEC_* setting of the caller's environment."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DSEC_")}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def no_leaks(hermetic):
    """Fail the session if it leaves processes, mounts, cgroups, netns, network interfaces
    or swap devices behind."""
    before = (set(our_processes()), mounts(), netns_entries(), cgroups(), links_and_swaps())
    yield
    deadline = time.monotonic() + 15
    while True:
        procs = {p: c for p, c in our_processes().items() if p not in before[0]}
        new_mounts = mounts() - before[1]
        new_netns = netns_entries() - before[2]
        new_cgroups = cgroups() - before[3]
        new_devices = links_and_swaps() - before[4]
        leaks = procs or new_mounts or new_netns or new_cgroups or new_devices
        if not leaks or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not procs, f"processes left behind: {procs}"
    assert not new_mounts, f"mounts left behind: {new_mounts}"
    assert not new_netns, f"network namespaces left behind: {new_netns}"
    assert not new_cgroups, f"cgroups left behind: {new_cgroups}"
    assert not new_devices, f"network interfaces or swap left behind: {new_devices}"


@pytest.fixture
def busybox_env(tmp_path) -> dict[str, str]:
    """A layer store under ``tmp_path`` holding the busybox base (``busybox:1``), as the
    settings that point services at it."""
    from dsec_storage_3fs.images import busybox_tree, ensure_layer

    from dsec_kernel.storage import open_store

    root = str(tmp_path / "store")
    store = open_store("3fs", {"root": root, "cache_dir": str(tmp_path / "cache")})
    ensure_layer(store, "base", "busybox", "1", busybox_tree)
    return {"DSEC_STORAGE_CONFIG__ROOT": root}


@pytest.fixture
def local_cluster(tmp_path):
    """A factory for LocalClusters (nats + apiservers + edges as processes), stopped after."""
    made: list[LocalCluster] = []

    def make(env: dict[str, str] | None = None) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster{len(made)}", env)
        made.append(cluster)
        cluster.start_nats()
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
