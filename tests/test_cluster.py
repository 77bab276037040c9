"""A real cluster on one machine: 3 NATS servers (JetStream replicated), 2 apiservers and 4
edges, each edge in its own network namespace (n4 in pool ``cloud``). It survives losing a
NATS server and an apiserver; a killed edge's sandboxes are reported lost and rebuilt
elsewhere by the SDK's recovery helper; restarting everything keeps the state."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from collections import Counter

import pytest
import pytest_asyncio
from dsec_backend_container.backend import ContainerBackend
from dsec_storage_3fs.images import busybox_tree, ensure_layer

import dsec_kernel as dsec
from dsec_kernel import bus
from dsec_kernel.cluster import LocalCluster
from dsec_kernel.loader import open_store
from dsec_kernel.state.buckets import BUCKETS
from dsec_kernel.state.jetstream import ensure_replicas
from dsec_kernel.trajectory import stream as trajectory_stream

REASON = ContainerBackend.unavailable_reason() or (
    None if shutil.which("nsenter") and shutil.which("unshare") else "no nsenter/unshare"
)
pytestmark = [
    pytest.mark.skipif(bool(REASON), reason=f"cannot run a container cluster here: {REASON}"),
    pytest.mark.asyncio(loop_scope="module"),
]
BUSYBOX = dsec.Env(base="busybox:1")
NODES = ("n1", "n2", "n3", "n4")


def _start_edge(cluster: LocalCluster, node: str) -> None:
    pool = ["--pool", "cloud"] if node == "n4" else []
    cluster.start_edge(node, ["container"], "--heartbeat", "0.3", *pool)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    root = str(tmp / "store")
    ensure_layer(open_store("3fs", {"root": root, "cache_dir": str(tmp / "cache")}),
                 "base", "busybox", "1", busybox_tree)  # fmt: skip
    env = {"DSEC_STORAGE_CONFIG__ROOT": root, "DSEC_BACKEND_CONFIG__CONTAINER__MAX_SANDBOXES": "4"}
    c = LocalCluster(tmp / "c", env, nats_servers=3, netns=True)
    try:
        c.start_nats()
        for _ in range(2):
            c.start_apiserver("--node-timeout", "2")
        for node in NODES:
            _start_edge(c, node)
        await c.ready(120)
        yield c
        async with c.client() as client:  # what a failed test left
            await client.destroy(await client.list())
    finally:
        c.stop()


async def _until(fn, timeout: float = 30.0) -> None:
    for _ in range(int(timeout * 10)):
        if await fn():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not met in time")


async def test_each_edge_is_a_node_of_its_own_and_bursts_go_to_the_cloud_pool(cluster):
    mine = os.readlink("/proc/self/ns/net")
    nets = {os.readlink(f"/proc/{cluster.edges[n].proc.pid}/ns/net") for n in NODES}
    assert len(nets) == 4 and mine not in nets
    async with cluster.client() as c:
        assert {n.node: n.pool for n in await c.nodes()} == {
            "n1": "default", "n2": "default", "n3": "default", "n4": "cloud"
        }  # fmt: skip
        staged = await c.prestage(["busybox:1"], pool="cloud")  # before the burst
        assert (staged.nodes, staged.failed) == (["n4"], [])
        await asyncio.sleep(0.8)
        assert {n.node for n in await c.nodes() if "busybox:1" in n.layers} == {"n4"}
        # on-prem holds 12; past 80 % full (10) new sandboxes go to the cloud pool
        first = await c.create(count=9, backend="container", env=BUSYBOX)
        assert set(Counter(sb.node for sb in first)) == {"n1", "n2", "n3"}
        tenth = await c.create(backend="container", env=BUSYBOX)
        assert tenth[0].node != "n4"
        await asyncio.sleep(0.8)  # heartbeats carry the new load
        burst = await c.create(count=2, backend="container", env=BUSYBOX)
        assert {sb.node for sb in burst} == {"n4"}
        r = await c.exec_many(first + tenth + burst, "echo ok")
        assert {x.stdout for x in r} == {b"ok\n"}
        await c.destroy(first + tenth + burst)


async def test_work_goes_on_without_a_nats_server_and_an_apiserver(cluster):
    async with cluster.client() as c:
        sbs = await c.create(count=4, backend="container", env=BUSYBOX)
        cluster.nats.servers[1].stop()
        cluster.apiservers[0].kill()
        more = await c.create(count=2, backend="container", env=BUSYBOX)
        r = await c.exec_many(sbs + more, "echo still")
        assert {x.stdout for x in r} == {b"still\n"}
        assert {sb.id for sb in await c.list()} == {sb.id for sb in sbs + more}
        cluster.nats.servers[1].start()  # both come back for the next tests
        cluster.apiservers[0] = cluster.start_apiserver("--node-timeout", "2")
        cluster.apiservers.pop()
        await cluster.ready(60)
        await c.destroy(sbs + more)


async def test_every_bucket_and_stream_has_three_copies(cluster):
    """On a 3-server cluster each KV bucket and trajectory stream is on all three; one made
    with fewer (a single-server run on the same state) is raised when next opened."""
    async with cluster.client() as c:
        [sb] = await c.create(count=1, backend="container", env=BUSYBOX)
        await sb.exec("true")  # the tenant's trajectory stream exists from here
        await c.destroy([sb])
    nc = await bus.connect(cluster.url, name="test-replicas")
    try:
        js = nc.jetstream()
        streams = {i.config.name: i.config.num_replicas for i in await js.streams_info()}
        assert {f"KV_{b}" for b in BUCKETS} | {trajectory_stream("default")} <= set(streams)
        assert set(streams.values()) == {3}, streams
        await js.create_key_value(bucket="dsec-scratch", replicas=1)
        deadline = time.monotonic() + 30  # (a server restarted by an earlier test may still
        while (await js.stream_info("KV_dsec-scratch")).config.num_replicas < 3:  # catch up)
            assert time.monotonic() < deadline, "the stream kept one replica"
            await ensure_replicas(js, "KV_dsec-scratch", 3)
            await asyncio.sleep(0.5)
        await js.delete_key_value("dsec-scratch")
    finally:
        await nc.close()


async def _info(js, stream: str):
    """``stream``'s info, asked again while JetStream is between leaders (at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await js.stream_info(stream)
        except Exception:  # no leader to answer yet: nats raises several kinds
            assert time.monotonic() < deadline, f"{stream} had no leader for 30 s"
            await asyncio.sleep(0.1)


async def _work_goes_on(c: dsec.AsyncClient, sb: dsec.Sandbox) -> str:
    """A create, an exec in it and in an older sandbox, a list that has both, a read of the
    older one's trajectory; then the new sandbox is destroyed. Returns each step's time."""
    took = []
    t = time.monotonic()

    def step(name: str) -> None:
        nonlocal t
        took.append(f"{name} {time.monotonic() - t:.1f}")
        t = time.monotonic()

    [new] = await c.create(count=1, backend="container", env=BUSYBOX)
    step("create")
    r = await c.exec_many([sb, new], "echo on")
    assert {x.stdout for x in r} == {b"on\n"}
    step("exec")
    assert {sb.id, new.id} <= {s.id for s in await c.list()}
    step("list")
    assert (await sb.trajectory())[-1].argv[-1] == "echo on"
    step("trajectory")
    await c.destroy([new])
    step("destroy")
    return ", ".join(took)


@pytest.mark.parametrize(
    "victim", ["KV_dsec-sandboxes", "KV_dsec-nodes", "KV_dsec-tenants", "trajectory", "random"]
)
async def test_sigkill_of_a_streams_leader_leaves_work_going_within_seconds(
    cluster, victim, measured
):
    """The server leading ``victim``'s stream (or a random one) is SIGKILLed, and at once a
    create, execs, a list and a trajectory read are asked for: they are done within
    seconds, nothing is reported lost, and how long the elections took is reported. The
    server then comes back and catches up for the next case."""
    streams = [f"KV_{b}" for b in BUCKETS] + [trajectory_stream("default")]
    nc = await bus.connect(cluster.url, name="test-leaders")
    try:
        js = nc.jetstream(timeout=0.5)  # a stream with no leader does not answer: ask again
        async with cluster.client() as c:
            [sb] = await c.create(count=1, backend="container", env=BUSYBOX)
            await sb.exec("true")
            if victim == "random":
                server = random.choice(cluster.nats.servers)
            else:
                stream = trajectory_stream("default") if victim == "trajectory" else victim
                leader = (await _info(js, stream)).cluster.leader
                server = next(s for s in cluster.nats.servers if s.name == leader)
            led = [s for s in streams if (await _info(js, s)).cluster.leader == server.name]
            server.proc.kill()
            t0 = time.monotonic()
            elections = asyncio.ensure_future(_elected(js, led, server.name, t0))
            steps = await asyncio.wait_for(_work_goes_on(c, sb), 30)
            resumed = time.monotonic() - t0
            elected = await elections
            server.proc.wait()
            measured("NATS failover (tests/test_cluster.py: SIGKILL of one of 3 servers)",
                     f"{server.name} ({'random' if victim == 'random' else 'leader of ' + victim}"
                     f", led {len(led)} of {len(streams)} streams): new leaders in "
                     f"{elected:.1f} s; create, exec, list, trajectory, destroy done "
                     f"{resumed:.1f} s after the kill ({steps})")  # fmt: skip
            server.start()
            await _caught_up(js, streams)
            assert (await sb.status()).state == "ready"
            await c.destroy([sb])
    finally:
        await nc.close()


async def _elected(js, streams: list[str], dead: str, t0: float) -> float:
    """Seconds from ``t0`` until each of ``streams`` has a leader other than ``dead``."""
    for stream in streams:
        while (await _info(js, stream)).cluster.leader in (None, dead):
            await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def _caught_up(js, streams: list[str]) -> None:
    """Each of ``streams`` has a leader and two current replicas (at most 60 s)."""
    deadline = time.monotonic() + 60
    for stream in streams:
        while True:
            info = await _info(js, stream)
            peers = info.cluster.replicas or []
            if info.cluster.leader and len(peers) == 2 and all(p.current for p in peers):
                break
            assert time.monotonic() < deadline, f"{stream} did not catch up: {info.cluster}"
            await asyncio.sleep(0.2)


async def test_a_killed_node_loses_its_sandboxes_and_recover_rebuilds_them(cluster):
    async with cluster.client() as c:
        sbs = await c.create(count=4, backend="container", env=BUSYBOX)
        for sb in sbs:
            await sb.exec(f"echo {sb.id} > /tmp/who")
            await sb.snapshot()
            await sb.exec("echo after >> /tmp/who")
        victim = sbs[0].node
        cluster.edges[victim].kill()
        on_victim = [sb for sb in sbs if sb.node == victim]
        await _until(lambda: _all_lost(on_victim))
        rebuilt = [await c.recover(sb) for sb in on_victim]
        for old, new in zip(on_victim, rebuilt, strict=True):
            assert new.node != victim
            assert (await new.read_file("/tmp/who")) == f"{old.id}\nafter\n".encode()
        _start_edge(cluster, victim)  # the node comes back: its edge clears what was left
        await cluster.ready(60)
        await c.destroy([sb for sb in sbs if sb.node != victim] + rebuilt)


async def _all_lost(sbs) -> bool:
    return [(await sb.status()).state for sb in sbs] == ["lost"] * len(sbs)


async def test_restarting_everything_keeps_the_state(cluster):
    async with cluster.client() as c:
        sbs = await c.create(count=3, backend="container", env=BUSYBOX)
        await c.exec_many(sbs, "echo kept > /tmp/k")
    cluster.stop()  # every process, and the network
    cluster.start_nats()
    for node in NODES:  # edges first: a fresh apiserver gives nodes a node timeout from its
        _start_edge(cluster, node)  # start, which four edges starting at once may overrun
    for i in range(2):
        cluster.apiservers[i] = cluster.start_apiserver("--node-timeout", "5")
    del cluster.apiservers[2:]
    await cluster.ready(120)
    async with cluster.client() as c:
        assert {sb.id for sb in await c.list()} == {sb.id for sb in sbs}
        r = await c.exec_many(sbs, "cat /tmp/k")
        assert {x.stdout for x in r} == {b"kept\n"}
        await c.destroy(sbs)
