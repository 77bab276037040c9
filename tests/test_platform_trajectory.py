"""Trajectories: the ordered log of a sandbox's commands, exactly-once resends, and a lost
sandbox rebuilt from its last snapshot plus the commands after it."""

from __future__ import annotations

import asyncio
import json

import pytest
from dsec_backend_container.backend import ContainerBackend

import dsec_kernel as dsec
from dsec_kernel.cluster import ensure_tenant
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import CommandRecord

REASON = ContainerBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(
    bool(REASON), reason=f"the container backend cannot run here: {REASON}"
)
BUSYBOX = dsec.Env(base="busybox:1")


@pytest.fixture
async def cluster(local_cluster, busybox_env):
    c = local_cluster(busybox_env)
    c.start_apiserver("--node-timeout", "1.5")
    return c


async def test_the_trajectory_logs_commands_results_and_snapshots_in_order(cluster):
    cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        (sb,) = await c.create(backend="container", env=BUSYBOX)
        await sb.exec("echo one; echo err >&2", env={"A": "1"}, cwd="/tmp")
        snap = await sb.snapshot()
        await sb.exec(["sh", "-c", "exit 3"])
        await sb.restore(snap)
        log = await sb.trajectory()
        assert [r.kind for r in log] == ["exec", "snapshot", "exec", "restore"]
        first = log[0]
        assert (first.stdout, first.stderr, first.env, first.cwd) == (
            b"one\n",
            b"err\n",
            {"A": "1"},
            "/tmp",
        )
        assert log[2].exit_code == 3 and log[1].snapshot_id == log[3].snapshot_id == snap.id
        assert [r.seq for r in log] == sorted(r.seq for r in log)
        assert [r.argv for r in await sb.commands()] == [first.argv, log[2].argv]
        lines = "\n".join(r.model_dump_json() for r in log).splitlines()  # JSON lines
        assert [CommandRecord.model_validate(json.loads(x)) for x in lines] == log
        await sb.destroy()
        assert len(await c.trajectory(sb.id)) == 4  # provenance outlives the sandbox
    conn = await ensure_tenant(cluster.url, "mallory", client_url=cluster.nats.client_url)
    async with dsec.AsyncClient(url=conn.url, token=conn.token) as other:
        assert await other.trajectory(sb.id) == []  # another tenant sees nothing


async def test_a_resent_command_runs_once_and_gets_the_first_result(cluster):
    cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        (sb,) = await c.create(backend="container", env=BUSYBOX)
        append = "echo x >> /tmp/log; wc -l < /tmp/log"
        first = await sb.exec(append, request_id="step-1")
        again = await sb.exec(append, request_id="step-1")
        assert first.stdout == again.stdout == b"1\n"
        both = await asyncio.gather(  # sent twice at once: still one run
            sb.exec(f"sleep 0.3; {append}", request_id="step-2"),
            sb.exec(f"sleep 0.3; {append}", request_id="step-2"),
        )
        assert [r.stdout for r in both] == [b"2\n", b"2\n"]
        assert (await sb.exec(append)).stdout == b"3\n"  # a fresh id runs
        cluster.edges["e"].stop()  # an edge restart forgets nothing: the log is in NATS
        cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
        await cluster.ready()
        assert (await sb.exec(append, request_id="step-1")).stdout == b"1\n"
        assert (await sb.read_file("/tmp/log")) == b"x\nx\nx\n"
        await sb.pause()
        with pytest.raises(errors.SandboxPaused):
            await sb.exec(append, request_id="step-4")
        await sb.resume()
        assert (await sb.exec(append, request_id="step-4")).stdout == b"4\n"  # not run before
        await sb.destroy()


async def test_a_lost_sandbox_is_rebuilt_from_its_snapshot_and_replayed(cluster):
    cluster.start_edge("a", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        (sb,) = await c.create(backend="container", env=BUSYBOX)
        await sb.exec("echo before > /tmp/a")
        await sb.snapshot()
        await sb.exec("echo after >> /tmp/a; mkdir /tmp/d")
        await sb.exec("echo x > /tmp/d/f", cwd="/tmp")
        with pytest.raises(errors.Conflict, match="not lost"):
            await c.recover(sb)
        cluster.start_edge("b", ["container"], "--heartbeat", "0.2")
        await cluster.ready()
        cluster.edges["a"].kill()  # the node dies
        for _ in range(100):
            if (await sb.status()).state == "lost":
                break
            await asyncio.sleep(0.1)
        assert (await sb.status()).state == "lost"
        new = await c.recover(sb)
        assert new.node == "b" and new.id != sb.id
        replayed = [x.argv[-1] for x in await new.commands()]
        assert replayed == ["echo after >> /tmp/a; mkdir /tmp/d", "echo x > /tmp/d/f"]
        r = await new.exec("cat /tmp/a /tmp/d/f")
        assert r.stdout == b"before\nafter\nx\n", r
        assert [x.id for x in await c.list()] == [new.id]  # the lost record went
        await new.destroy()
        cluster.start_edge("a", ["container"], "--heartbeat", "0.2")  # the node comes back:
        await cluster.ready()  # its edge removes what the dead one left (reconciliation)


async def test_a_tenant_logging_a_lot_forgets_its_own_history_not_anothers(
    local_cluster, busybox_env
):
    """Each tenant's trajectory is a stream of its own, of bounded size (1 MiB here): one
    that logs 4 MiB of commands loses its oldest entries; the victim's log is whole."""
    cluster = local_cluster({**busybox_env, "DSEC_TRAJECTORY_MB_PER_TENANT": "1"})
    cluster.start_apiserver()
    cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with (
        cluster.client() as victim,
        await cluster.tenant_client("mallory") as m,
    ):
        (mine,) = await victim.create(backend="container", env=BUSYBOX)
        await mine.exec("echo kept")
        (theirs,) = await m.create(backend="container", env=BUSYBOX)
        big = {"X": "y" * (512 << 10)}  # 0.5 MiB of environment per command
        for _ in range(8):
            await theirs.exec("true", env=big)
        assert len(await theirs.trajectory()) < 8  # its own oldest went
        assert [r.stdout for r in await mine.trajectory()] == [b"kept\n"]
        with pytest.raises(errors.InvalidArgument, match="at most"):
            await theirs.exec("true", env={"X": "y" * (1 << 20)})
        await victim.destroy([mine])
        await m.destroy([theirs])
