"""Shared test fixtures: real platform processes (nats-server, apiservers, edges) and a leak check.

The session runs in cgroups of its own, so everything it starts (services, sandboxes,
their cgroups) stays below them, and ends by checking that the tests left no process or
cgroup there, no mount below its temporary directory, and no new network namespace,
interface or swap device on the machine. Other work sharing the machine is not counted
against it (but for interfaces and swap, which have no owner to tell).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from dsec_kernel.cluster import LocalCluster
from dsec_kernel.linuxhost.cgroups import Group, v1_controllers, v2_own

pytest.register_assert_rewrite("dsec_kernel.contract.conformance")  # before any test imports it


def session_processes(groups: dict[str, Path]) -> dict[int, str]:
    """pid -> command line of every process in this session's cgroups (but pytest)."""
    found = {}
    # (os.walk skips what vanishes meanwhile; rglob raised for a group removed mid-walk)
    for d, _, _ in os.walk(groups["pids"]) if "pids" in groups else ():
        try:
            pids = Path(d, "cgroup.procs").read_text().split()
        except OSError:
            continue
        for pid in map(int, pids):
            if pid == os.getpid():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            found[pid] = cmd.decode(errors="replace")[:200]
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


def mounts(below: str) -> set[str]:
    """Mount points under ``below`` (where this session's files are) with their source and
    type."""
    found = (line.split()[:3] for line in Path("/proc/self/mounts").read_text().splitlines())
    return {" ".join(m) for m in found if m[1].startswith(below)}


def uid_claims(below: str) -> set[str]:
    """Sandboxes' uid range claims (/run/dsec/userns) for sandbox directories under
    ``below``."""
    try:
        entries = list(Path("/run/dsec/userns").iterdir())
    except FileNotFoundError:
        return set()
    found = set()
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith(below):
            found.add(target)
    return found


def cgroups() -> set[str]:
    """DSec's cgroups below this process's own, in every hierarchy (v1 and cgroup2)."""
    own = [*v1_controllers().values(), *filter(None, [v2_own()])]
    return {str(p) for d in own for p in d.glob("dsec*")}


def _occupied(group: Path) -> bool:
    """Whether a process is in ``group`` or any group below it (True if it cannot be read)."""
    try:
        return any(
            (d / "cgroup.procs").read_text().strip()
            for d in (group, *group.rglob("*"))
            if d.is_dir()
        )
    except OSError:
        return True


@pytest.fixture(scope="session", autouse=True)
def hermetic():
    """Tests see no DSEC_* setting of the caller's environment."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DSEC_")}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def session_cgroups(hermetic):
    """Move pytest into a cgroup of its own in every hierarchy that takes it (v1 cpuset,
    with no CPUs of its own, does not; cgroup2 as "unified"); back out at the end, and remove
    them with whatever is left in them (the leak check has reported it by then). Empty groups
    of earlier sessions killed before they could clean up go at the start; a group with a
    process anywhere in it is left alone whole (another session's, maybe in another PID
    namespace: the empty groups inside it are its services' own, such as an idle fncall
    edge's cpu group, which a removal would pull from under it)."""
    parents = v1_controllers() | ({"unified": own} if (own := v2_own()) else {})
    me = str(os.getpid())
    for controller, parent in parents.items():
        for old in parent.glob("dsec-tests-*"):
            if not _occupied(old):
                with contextlib.suppress(OSError):  # someone's, come to life meanwhile
                    Group({controller: old}).remove(timeout=0)
    made: dict[str, Path] = {}
    for controller, parent in parents.items():
        group = parent / f"dsec-tests-{me}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(me)
            made[controller] = group
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
    yield made
    for controller in made:
        (parents[controller] / "cgroup.procs").write_text(me)
    Group(made).remove(timeout=15, kill=True)


@pytest.fixture(scope="session", autouse=True)
def no_leaks(session_cgroups, tmp_path_factory):
    """Fail the session if it leaves processes, mounts, cgroups, netns, network interfaces
    or swap devices behind."""
    here = str(tmp_path_factory.getbasetemp())
    before = (set(session_processes(session_cgroups)), mounts(here), netns_entries(), cgroups(),
              links_and_swaps(), uid_claims(here))  # fmt: skip
    yield
    deadline = time.monotonic() + 15
    while True:
        procs = {p: c for p, c in session_processes(session_cgroups).items() if p not in before[0]}
        new_mounts = mounts(here) - before[1]
        new_netns = netns_entries() - before[2]
        new_cgroups = cgroups() - before[3]
        new_devices = links_and_swaps() - before[4]
        new_claims = uid_claims(here) - before[5]
        leaks = procs or new_mounts or new_netns or new_cgroups or new_devices or new_claims
        if not leaks or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not procs, f"processes left behind: {procs}"
    assert not new_mounts, f"mounts left behind: {new_mounts}"
    assert not new_netns, f"network namespaces left behind: {new_netns}"
    assert not new_cgroups, f"cgroups left behind: {new_cgroups}"
    assert not new_devices, f"network interfaces or swap left behind: {new_devices}"
    assert not new_claims, f"uid ranges left claimed: {new_claims}"


_MEASURED: dict[str, list[str]] = {}


@pytest.fixture
def measured():
    """``measured(section, line)``: a figure the session prints at its end, under ``section``
    (what tests observe that a reader should see, such as how long an election took)."""
    return lambda section, line: _MEASURED.setdefault(section, []).append(line)


def pytest_terminal_summary(terminalreporter) -> None:
    for section, lines in _MEASURED.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def nats_as():
    """``await nats_as(url, token)``: a bare NATS connection (no reconnects) with the login of
    a tenant credential, and the errors NATS sends it (lower case), as an attacker would
    hold them."""
    import nats

    from dsec_kernel import bus

    async def connect(url: str, token: str):
        seen: list[str] = []

        async def on_error(exc: Exception) -> None:
            seen.append(str(exc).lower())

        login = bus.Login.for_token(token)
        nc = await nats.connect(
            url,
            user=login.user,
            password=login.password,
            inbox_prefix=login.inbox_prefix,
            error_cb=on_error,
            allow_reconnect=False,
        )
        return nc, seen

    return connect


@pytest.fixture
def busybox_env(tmp_path) -> dict[str, str]:
    """A layer store under ``tmp_path`` holding the busybox base (``busybox:1``), as the
    settings that point services at it."""
    from dsec_storage_3fs.images import busybox_tree, ensure_layer

    from dsec_kernel.loader import open_store

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
