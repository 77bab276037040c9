"""Batch calls answer every sandbox, on a platform of processes: the result of each that
could be served, in order, and a typed error in place of each that could not (destroyed,
paused or busy meanwhile, its node not answering, lost with its node, past the quota);
they raise only when the request as a whole fails. The async client, the sync one and the
command line alike."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_fncall.backend import FncallBackend

import dsec_kernel as dsec
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import Quota

REASON = ContainerBackend.unavailable_reason() or FncallBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(
    bool(REASON), reason=f"the container and fncall backends cannot run here: {REASON}"
)
BUSYBOX = dsec.Env(base="busybox:1")
DONE = type(None)


def kinds(entries: list) -> list[type]:
    """The class of each entry's error (``DONE`` where there is none)."""
    return [type(e.error) for e in entries]


async def until_state(sb: dsec.Sandbox, state: str, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while (await sb.status()).state != state:
            await asyncio.sleep(0.1)


def dsec_cli(cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_URL": cluster.conn.url, "DSEC_TOKEN": cluster.conn.token}
    return subprocess.run([sys.executable, "-m", "dsec_kernel.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


async def test_batches_answer_every_sandbox_in_order(local_cluster, busybox_env):
    cluster = local_cluster(busybox_env)
    cluster.start_apiserver("--node-timeout", "15")  # room to see a node that does not answer
    cluster.start_edge("c", ["container"], "--heartbeat", "0.2")
    cluster.start_edge("f", ["fncall"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        made = await c.create(count=4, backend="container", env=BUSYBOX)
        ok, gone, paused, busy = dsec.check(made)
        (fn,) = await c.create(backend="fncall")
        await gone.destroy()
        await paused.pause()
        running = asyncio.ensure_future(busy.exec("touch /tmp/started; sleep 4", timeout=30))
        async with asyncio.timeout(20):
            while "started" not in (await busy.exec("ls /tmp", timeout=5)).stdout.decode():
                await asyncio.sleep(0.05)

        ran = await c.exec_many([ok, gone, paused, fn], "echo ran")
        assert [r.sandbox_id for r in ran] == [ok.id, gone.id, paused.id, fn.id]
        assert kinds(ran) == [DONE, errors.NotFound, errors.SandboxPaused, DONE], ran
        assert [r.stdout for r in ran] == [b"ran\n", b"", b"", b"ran\n"]
        with pytest.raises(errors.SandboxPaused):  # one sandbox: its error raised
            await paused.exec("true")
        with pytest.raises(errors.NotFound):
            await gone.exec("true")

        reports = await c.pause([ok, gone, busy])
        assert [r.sandbox_id for r in reports] == [ok.id, gone.id, busy.id]
        assert kinds(reports) == [DONE, errors.NotFound, errors.Conflict], reports
        assert reports[0].state == "paused" and reports[0].memory_before_bytes > 0
        with pytest.raises(errors.Conflict, match="running"):
            await busy.pause()
        reports = await c.resume([ok, gone, paused])
        assert kinds(reports) == [DONE, errors.NotFound, DONE], reports
        assert [r.state for r in reports] == ["ready", "", "ready"]
        assert (await running).exit_code == 0

        cluster.edges["f"].kill()  # fn's node stops answering; it is not marked down yet
        ran = await c.exec_many([ok, fn], "echo ran")
        assert kinds(ran) == [DONE, errors.Unavailable] and ran[0].stdout == b"ran\n", ran
        (report,) = await c.destroy([fn])
        assert isinstance(report.error, errors.Unavailable) and report.found, report
        assert fn.id in {sb.id for sb in await c.list()}  # still there: destroy it again
        cli = await asyncio.to_thread(dsec_cli, cluster, "destroy", fn.id)
        assert cli.returncode == errors.Unavailable.exit_status, cli.stderr
        assert cli.stderr.startswith(f"dsec: {fn.id}: [unavailable] "), cli.stderr
        assert cli.stdout == "destroyed 0\n"

        await until_state(fn, "lost")  # its node is marked down
        ran = await c.exec_many([ok, fn], "true")
        assert kinds(ran) == [DONE, errors.SandboxLost], ran
        reports = await c.destroy([ok, gone, paused, busy, fn])
        assert kinds(reports) == [DONE] * 5, reports
        assert [r.found for r in reports] == [True, False, True, True, True]
        assert await c.list() == []
        with pytest.raises(errors.InvalidArgument):  # the request as a whole: raised
            await c.exec_many([ok], "true", timeout=-1)


def test_the_sync_client_and_a_create_past_the_quota(local_cluster, busybox_env):
    """The synchronous client answers batches the same way; a create of five under a quota
    of three makes three, with an entry for each of the other two (nothing of them left
    anywhere), and raises when it can make none."""
    cluster = local_cluster(busybox_env)
    asyncio.run(cluster.set_quota("default", Quota(sandboxes=3)))  # read at the start
    cluster.start_apiserver()
    cluster.start_edge("c", ["container"], "--heartbeat", "0.2")
    asyncio.run(cluster.ready())
    with dsec.Client(url=cluster.conn.url, token=cluster.conn.token) as c:
        made = c.create(count=5, backend="container", env=BUSYBOX)
        assert kinds(made) == [DONE] * 3 + [errors.QuotaExceeded] * 2, made
        assert all(isinstance(sb, dsec.SyncSandbox) for sb in made[:3])
        assert isinstance(made[3], dsec.NotCreated) and "quota of 3" in made[3].error.message
        assert {sb.id for sb in c.list()} == {sb.id for sb in made[:3]}
        with pytest.raises(errors.QuotaExceeded, match="sandboxes"):  # none can be made
            c.create(backend="container", env=BUSYBOX)
        with pytest.raises(errors.InvalidArgument, match=r"sandboxes\[1\]"):
            c.exec_many([made[0], made[3]], "true")

        ok, gone, paused = made[:3]
        gone.destroy()
        paused.pause()
        ran = c.exec_many([ok, gone, paused], "echo ran")
        assert kinds(ran) == [DONE, errors.NotFound, errors.SandboxPaused], ran
        assert ran[0].stdout == b"ran\n"
        with pytest.raises(errors.NotFound):
            gone.exec("true")
        assert kinds(c.pause([ok, gone])) == [DONE, errors.NotFound]
        assert kinds(c.resume([ok, gone, paused])) == [DONE, errors.NotFound, DONE]
        with pytest.raises(errors.NotFound, match=r"\(and 1 more of 3\)"):
            dsec.check(c.exec_many([gone, ok, gone], "true"))
        reports = c.destroy([ok, gone, paused])
        assert [(r.found, r.error) for r in reports] == [(True, None), (False, None), (True, None)]
        assert c.list() == []
