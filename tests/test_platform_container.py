"""Container sandboxes through the SDK on a platform of processes: environments, snapshots,
restore, forks on other nodes, published layers, and an edge killed in the middle of a create."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend

import dsec_kernel as dsec
from dsec_kernel.contract import errors

REASON = ContainerBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(
    bool(REASON), reason=f"the container backend cannot run here: {REASON}"
)
BUSYBOX = dsec.Env(base="busybox:1")


@pytest.fixture
def cluster(local_cluster, busybox_env):
    c = local_cluster(busybox_env)
    c.start_apiserver("--node-timeout", "2")
    return c


async def test_an_rl_step_loop_through_the_sdk(local_cluster, busybox_env):
    # room for 4 sandboxes a node: the 4 forks must use both nodes, whatever the nodes' load
    # (both report this machine's, read at different times: it decided the spread alone)
    cluster = local_cluster({**busybox_env, "DSEC_BACKEND_CONFIG__CONTAINER__MAX_SANDBOXES": "4"})
    cluster.start_apiserver()
    cluster.start_edge("n1", ["container"], "--heartbeat", "0.2")
    cluster.start_edge("n2", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        sbs = await c.create(count=2, backend="container", env=BUSYBOX,
                             limits=dsec.Limits(cpus=1, memory_mb=256, pids=128))  # fmt: skip
        assert Counter(sb.node for sb in sbs) == {"n1": 1, "n2": 1}
        results = await c.exec_many(sbs, "echo step0 > /tmp/state; hostname", timeout=10)
        assert [r.stdout for r in results] == [b"sandbox\n"] * 2
        sb = sbs[0]
        await sb.write_file("/work/solution.py", "print('v1')\n")
        snap = await sb.snapshot()
        await sb.exec("echo v2 > /work/solution.py; rm /tmp/state; sleep 100 &")
        diff = await sb.fs_diff(since=snap)
        assert (diff.modified, diff.deleted) == (["/work/solution.py"], ["/tmp/state"])
        assert set((await sb.fs_diff()).added) >= {"/work", "/work/solution.py"}
        await sb.restore(snap)
        r = await sb.exec("cat /work/solution.py /tmp/state; ps -o args | grep -c '^sleep' || true")
        assert r.stdout == b"print('v1')\nstep0\n0\n"
        forks = await c.create(count=4, from_snapshot=snap)
        assert {f.backend for f in forks} == {"container"} and len({f.node for f in forks}) == 2
        outs = await c.exec_many(forks, "cat /work/solution.py")
        assert [o.stdout for o in outs] == [b"print('v1')\n"] * 4
        history = await sb.commands()
        assert [h.exit_code for h in history] == [0, 0, 0] and history[0].argv[-1].startswith(
            "echo step0"
        )
        layer = await c.publish(snap, kind="workspace", name="solution", version="1")
        [user] = await c.create(count=1, backend="container",
                                env=dsec.Env(base="busybox:1", workspace="solution:1"))  # fmt: skip
        assert (await user.exec("cat /work/solution.py")).stdout == b"print('v1')\n"
        assert layer.name == "solution"
        await sb.reset()
        assert (await sb.exec("ls /work 2>&1; echo $?")).stdout.endswith(b"1\n")
        # the apiserver checks every layer before placing: one error naming each missing one
        missing = dsec.Env(base="nope:1", workspace="solution:1", toolkits=["nada:2"])
        with pytest.raises(errors.NotFound) as gone:
            await c.create(count=1, backend="container", env=missing)
        assert "nope:1" in str(gone.value) and "nada:2" in str(gone.value), gone.value
        assert "solution:1" not in str(gone.value)
        with pytest.raises(errors.NotFound, match="nope:1"):
            await c.pool(name="missing", size=1, backend="container", env=missing)
        await c.destroy([*sbs, *forks, user])
        assert await c.list() == []


def cgroup_sandboxes(backend_dir: Path) -> list[str]:
    """The sandbox cgroups of the container backend keeping its state in ``backend_dir``."""
    import hashlib

    from dsec_kernel.linuxhost.cgroups import v1_controllers

    own = hashlib.sha256(str(backend_dir.resolve()).encode()).hexdigest()[:12]
    return [str(p) for p in v1_controllers()["pids"].glob(f"dsec-container-{own}/sb-*")]


async def test_an_egress_sandbox_through_the_sdk(cluster):
    """network="egress" end to end: the edge (on its own event loop, uvloop) makes the veth."""
    cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        out, closed = await asyncio.gather(
            c.create(count=1, backend="container", env=BUSYBOX, network="egress"),
            c.create(count=1, backend="container", env=BUSYBOX),
        )
        show = "ip -o link | cut -d: -f2 | tr -d ' ' | sort | tr '\\n' ' '; ip route"
        try:
            r = await out[0].exec(show)
            assert r.stdout.startswith(b"eth0@") and b"default via 10.213.0.1" in r.stdout, r
            assert (await closed[0].exec(show)).stdout == b"lo "
        finally:
            await c.destroy(out + closed)


async def test_an_edge_killed_mid_create_leaves_nothing_after_it_restarts(cluster):
    cluster.start_edge("a", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    backend_dir = Path(cluster.state_dir, "nodes", "a", "backends", "container")
    async with cluster.client() as c:
        creating = asyncio.ensure_future(c.create(count=60, backend="container", env=BUSYBOX))
        deadline = time.monotonic() + 20
        while not cgroup_sandboxes(backend_dir) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cluster.edges["a"].kill()  # mid-create: some sandboxes exist, none is recorded
        with pytest.raises(errors.DsecError):
            await creating
        assert cgroup_sandboxes(backend_dir), "the edge should have died mid-create"
        cluster.start_edge("a", ["container"], "--heartbeat", "0.2")
        await cluster.ready()
        assert await c.list() == []

        def files_left() -> list[Path]:  # sandbox directories, and those still being deleted
            sandboxes = backend_dir / "sandboxes"
            return [p for p in sandboxes.iterdir() if p.name != ".trash"] + list(
                (sandboxes / ".trash").iterdir()
            )

        for _ in range(100):
            if not cgroup_sandboxes(backend_dir) and not files_left():
                break
            await asyncio.sleep(0.1)
        assert cgroup_sandboxes(backend_dir) == []
        assert files_left() == []
        [sb] = await c.create(count=1, backend="container", env=BUSYBOX)  # and it still serves
        assert (await sb.exec("echo ok")).stdout == b"ok\n"
        await c.destroy([sb])
