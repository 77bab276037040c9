"""Pause, resume and idle pausing through the SDK, on a platform of processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_container.reclaim import hierarchy_root, paused_anywhere

import dsec_kernel as dsec
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import Quota

REASON = ContainerBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(
    bool(REASON), reason=f"the container backend cannot run here: {REASON}"
)
BUSYBOX = dsec.Env(base="busybox:1")
COUNTER = "(setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.05; done' &)"


@pytest.fixture
async def cluster(local_cluster, busybox_env):
    c = local_cluster(busybox_env)
    c.start_apiserver()
    c.start_edge("e", ["container"], "--heartbeat", "0.2")
    await c.ready()
    return c


async def _count(sb) -> int:
    return int(await sb.read_file("/tmp/n"))


async def test_pause_and_resume_keep_processes_and_files(cluster):
    async with cluster.client() as c:
        (sb,) = await c.create(backend="container", env=BUSYBOX)
        try:
            await sb.exec(f"echo kept > /tmp/f; {COUNTER}")
            await asyncio.sleep(0.3)
            report = await sb.pause()
            assert report.state == "paused" and report.memory_before_bytes > 0, report
            info = await sb.status()
            assert (info.state, info.paused_reason) == ("paused", "requested")
            n = await _count(sb)  # files can be read while paused
            with pytest.raises(errors.SandboxPaused, match="resume"):
                await sb.exec("true")
            await asyncio.sleep(0.3)
            assert await _count(sb) == n
            assert (await sb.resume()).state == "ready"
            assert (await sb.status()).state == "ready"
            await asyncio.sleep(0.3)
            assert await _count(sb) > n
            assert (await sb.exec("cat /tmp/f")).stdout == b"kept\n"
            nodes = await c.nodes()
            assert nodes[0].load.paused == 0
        finally:
            await c.destroy([sb])


async def test_a_batch_pause_reports_each_and_a_stranger_apart(cluster):
    async with cluster.client() as c:
        sbs = await c.create(count=3, backend="container", env=BUSYBOX)
        try:
            reports = await c.pause(sbs)
            assert [r.sandbox_id for r in reports] == [sb.id for sb in sbs]
            assert {(await sb.status()).state for sb in sbs} == {"paused"}
            mine, stranger = await c.pause([sbs[0], "sb-" + "0" * 16])
            assert (mine.state, mine.error) == ("paused", None)  # (idempotent)
            assert isinstance(stranger.error, errors.NotFound), stranger
            await c.resume(sbs)
            assert [r.exit_code for r in await c.exec_many(sbs, "true")] == [0, 0, 0]
        finally:
            await c.destroy(sbs)  # paused or not


async def test_an_idle_sandbox_pauses_and_its_next_command_resumes_it(cluster):
    async with cluster.client() as c:
        (sb,) = await c.create(backend="container", env=BUSYBOX, idle_ttl=1)
        try:
            await sb.exec(COUNTER)
            for _ in range(50):
                if (await sb.status()).state == "paused":
                    break
                await asyncio.sleep(0.1)
            info = await sb.status()
            assert (info.state, info.paused_reason) == ("paused", "idle")
            n = await _count(sb)
            r = await sb.exec("cat /tmp/n")
            assert r.exit_code == 0 and int(r.stdout) >= n
            assert (await sb.status()).state == "ready"
        finally:
            await sb.destroy()


async def test_a_backend_that_cannot_pause_says_so(cluster):
    cluster.start_edge("f", ["noop"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        (sb,) = await c.create(backend="noop")
        with pytest.raises(errors.Unsupported, match="cannot pause"):
            await sb.pause()
        await sb.destroy()


async def test_a_lapsed_lease_pauses_the_job_and_a_renewal_resumes_it(cluster):
    async with cluster.client() as c:
        async with c.job("grpo-step-1", priority=5, lease_s=1) as job:
            sbs = await job.create(count=2, backend="container", env=BUSYBOX)
            assert {sb.info.job for sb in sbs} == {"grpo-step-1"}
            await c.exec_many(sbs, f"echo kept > /tmp/f; {COUNTER}")
            await asyncio.sleep(1.5)  # renewals every lease_s / 3 keep it running
            assert {(await sb.status()).state for sb in sbs} == {"ready"}
            job.stop_renewing()  # the trainer is preempted
            for _ in range(60):
                if {(await sb.status()).state for sb in sbs} == {"paused"}:
                    break
                await asyncio.sleep(0.1)
            assert [(await sb.status()).paused_reason for sb in sbs] == ["lease", "lease"]
            with pytest.raises(errors.SandboxPaused, match="renew"):
                await sbs[0].exec("true")
            with pytest.raises(errors.SandboxPaused, match="lapsed"):
                await job.create(backend="container", env=BUSYBOX)
            counts = [await _count(sb) for sb in sbs]
            await asyncio.sleep(0.3)
            assert [await _count(sb) for sb in sbs] == counts  # frozen
            await job.renew()  # the trainer is back
            assert {(await sb.status()).state for sb in sbs} == {"ready"}
            await asyncio.sleep(0.3)
            after = [await _count(sb) for sb in sbs]
            assert all(a > n for a, n in zip(after, counts, strict=True)), (after, counts)
            assert [r.stdout for r in await c.exec_many(sbs, "cat /tmp/f")] == [b"kept\n"] * 2
            assert {sb.id for sb in await job.sandboxes()} == {sb.id for sb in sbs}
        assert await c.list() == []  # the job ended: its sandboxes went with it
        with pytest.raises(errors.InvalidArgument, match="open it first"):
            await c.create(backend="container", env=BUSYBOX, job="grpo-step-1")


async def test_a_higher_priority_job_pauses_lower_ones_to_get_room(local_cluster, busybox_env):
    """Room for 3: a priority-1 job holds it; a priority-9 job asks for 2 and gets them by
    pausing two of the first job's sandboxes (not its one near its end); when the
    priority-9 job ends, they resume."""
    cluster = local_cluster({**busybox_env, "DSEC_BACKEND_CONFIG__CONTAINER__MAX_SANDBOXES": "4"})
    cluster.start_apiserver()
    cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        low = c.job("rollouts", priority=1, lease_s=30)
        await low.renew()
        lows = await low.create(count=3, backend="container", env=BUSYBOX)
        (ending,) = await low.create(backend="container", env=BUSYBOX, ttl=30)  # protected
        await c.exec_many(lows, "echo mine > /tmp/f")
        async with c.job("eval", priority=9, lease_s=30) as high:
            highs = await high.create(count=2, backend="container", env=BUSYBOX, wait=20)
            states = {sb.id: (await sb.status()) for sb in [*lows, ending]}
            paused = [i for i, s in states.items() if s.state == "paused"]
            assert len(paused) == 2, states
            assert {states[i].paused_reason for i in paused} == {"priority"}
            assert states[ending.id].state == "ready"
            assert [r.exit_code for r in await c.exec_many(highs, "true")] == [0, 0]
        for _ in range(100):  # the eval job ended: room again, the paused ones resume
            if {(await sb.status()).state for sb in lows} == {"ready"}:
                break
            await asyncio.sleep(0.1)
        assert [r.stdout for r in await c.exec_many(lows, "cat /tmp/f")] == [b"mine\n"] * 3
        await low.close()


async def test_another_tenants_priority_pauses_nothing_unless_the_operator_grants_it(
    local_cluster, busybox_env
):
    """Priorities are the tenant's to choose, so against other tenants a job counts only up
    to its tenant's ceiling (0 by default): a priority-100 job of another tenant neither
    pauses the victim's sandboxes nor jumps its queue, until the operator raises that
    tenant's max_priority."""
    cluster = local_cluster({**busybox_env, "DSEC_BACKEND_CONFIG__CONTAINER__MAX_SANDBOXES": "3"})
    cluster.start_apiserver()
    cluster.start_edge("e", ["container"], "--heartbeat", "0.2")
    await cluster.ready()
    async with (
        cluster.client() as victim,
        await cluster.tenant_client("mallory") as m,
        victim.job("train", priority=0, lease_s=60) as job,
        m.job("jump", priority=100, lease_s=60) as theirs,
    ):
        mine = await job.create(count=3, backend="container", env=BUSYBOX)
        with pytest.raises(errors.CapacityExceeded):
            await theirs.create(backend="container", env=BUSYBOX, wait=3)
        assert {(await sb.status()).state for sb in mine} == {"ready"}
        await cluster.set_quota("mallory", Quota(max_priority=100))
        await asyncio.sleep(1)  # the apiserver's mirror of quotas
        (got,) = await theirs.create(backend="container", env=BUSYBOX, wait=20)
        states = [(await sb.status()).state for sb in mine]
        assert states.count("paused") == 1, states  # granted: it stands higher now
        await m.destroy([got])


async def test_the_cli_pauses_resumes_and_lists_why(cluster):
    conn = cluster.conn
    env = {**os.environ, "DSEC_URL": conn.url, "DSEC_TOKEN": conn.token, "COLUMNS": "200"}

    async def dsec_cli(*args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dsec_kernel.cli", *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    sid = (await dsec_cli("create", "--backend", "container", "--base", "busybox:1")).strip()
    assert "paused in" in await dsec_cli("pause", sid)
    assert "paused (requested)" in await dsec_cli("ls")
    assert "ready in" in await dsec_cli("resume", sid)
    await dsec_cli("destroy", sid)


ZRAM_RECORD = Path("/run/dsec/zram-swap")


def _dsec_swap() -> tuple[str, bytes] | None:
    """The active device DSec's record names, and the UUID in its swap header (which tells
    it from a later device of the same name)."""
    swaps = [line.split()[0] for line in Path("/proc/swaps").read_text().splitlines()[1:]]
    with contextlib.suppress(FileNotFoundError):
        if (dev := ZRAM_RECORD.read_text().strip()) in swaps:
            with open(dev, "rb") as f:
                return dev, f.read(4096)[1036:1052]
    return None


async def test_the_nodes_swap_goes_when_nothing_on_it_is_paused(cluster):
    """The edge makes zram swap at the first pause on a node with none; it goes once the
    last paused sandbox is resumed, and again once it is destroyed."""
    if not Path("/sys/class/zram-control").exists():
        pytest.skip("no zram on this node: DSec makes no swap")
    if active := [line.split()[0] for line in Path("/proc/swaps").read_text().splitlines()[1:]]:
        pytest.skip(f"the node has swap already ({active}): this test needs a node without")

    async def gone(said: tuple[str, bytes]) -> None:
        for _ in range(200):
            if _dsec_swap() != said:
                return
            await asyncio.sleep(0.05)
        if paused_anywhere(hierarchy_root(Path("/sys/fs/cgroup/freezer"))):
            pytest.skip("another edge on this node has a paused sandbox: the swap stays for it")
        raise AssertionError(f"DSec's swap ({said}) is still there")

    async with cluster.client() as c:
        (sb,) = await c.create(backend="container", env=BUSYBOX)
        try:
            await sb.pause()
            said = _dsec_swap()
            assert said, Path("/proc/swaps").read_text()
            await sb.resume()
            await gone(said)
            await sb.pause()
            said = _dsec_swap()
            assert said
        finally:
            await c.destroy([sb])
        await gone(said)
