"""The whole platform as separate processes (nats-server, apiserver, edges with fncall),
driven through the SDK and the CLI, with faults: edges killed mid-call and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dsec_backend_fncall.backend import FncallBackend

import dsec_kernel as dsec
from dsec_kernel.contract import errors

ROOT = Path(__file__).resolve().parent.parent
REASON = FncallBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
ENV = {"DSEC_BACKEND_CONFIG__FNCALL__POOL_SIZE": "4"}


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.fixture
def cluster(local_cluster):
    c = local_cluster(ENV)
    c.start_apiserver("--node-timeout", "2")
    return c


async def test_sdk_end_to_end(cluster):
    cluster.start_edge("n1", ["fncall"])
    await cluster.ready()
    async with cluster.client() as c:
        sbs = await c.create(count=8, backend="fncall", ttl=600)
        results = await c.exec_many(sbs, "echo hi", timeout=10)
        assert [r.stdout for r in results] == [b"hi\n"] * 8
        sb = sbs[0]
        await sb.write_file("/tmp/a.txt", b"data")
        assert await sb.read_file("/tmp/a.txt") == b"data"
        r = await sb.exec(
            ["python3", "-c", "print(open('/tmp/a.txt').read())"],
            timeout=10,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/tmp",
            stdin=b"",
        )
        assert (r.stdout, r.exit_code, r.timed_out, r.truncated) == (b"data\n", 0, False, False)
        assert r.duration_s > 0
        out = await c.fncall("print(6*7)", language="python", timeout=5)
        assert out.stdout == b"42\n"
        out = await c.fncall("cat /tmp/a.txt", language="bash", sandbox=sb)
        assert out.stdout == b"data"
        r = await sb.exec("sleep 30", timeout=0.5)
        assert r.timed_out and r.exit_code == -9
        r = await sb.exec("head -c 100000000 /dev/zero", max_output_bytes=1000)
        assert r.truncated and len(r.stdout) == 1000
        with pytest.raises(errors.NotFound):
            await sb.read_file("/tmp/missing")
        with pytest.raises(errors.InvalidArgument):
            await sb.exec("true", timeout=-1)
        with pytest.raises(errors.InvalidArgument):
            await sb.write_file("/etc/passwd", b"x")
        with pytest.raises(errors.NotFound):
            await c.get("sb-0000000000000000")
        ran = await c.exec_many([sbs[1], sbs[2]], "exit 3")
        assert [(r.exit_code, r.error) for r in ran] == [(3, None), (3, None)]
        async with sbs[1]:
            pass  # the context manager destroys it
        assert sbs[1].id not in {s.id for s in await c.list()}
        await c.destroy(sbs)
        assert await c.list() == []


def test_sync_client(cluster):
    cluster.start_edge("n1", ["fncall"])
    asyncio.run(cluster.ready())
    with dsec.Client(url=cluster.conn.url, token=cluster.conn.token) as c:
        [sb] = c.create(count=1, backend="fncall")
        assert isinstance(sb, dsec.SyncSandbox)
        assert sb.exec("echo sync").stdout == b"sync\n"
        sb.write_file("/tmp/x", "text")
        assert sb.read_file("/tmp/x") == b"text"
        assert [r.stdout for r in c.exec_many([sb], "echo many")] == [b"many\n"]
        assert c.fncall("print(1)").stdout == b"1\n"
        assert [s.id for s in c.list()] == [sb.id]
        with sb:
            pass
        assert c.list() == []


async def test_edge_killed_mid_call(cluster):
    cluster.start_edge("a", ["fncall"], "--heartbeat", "0.2")
    cluster.start_edge("b", ["fncall"], "--heartbeat", "0.2")
    await cluster.ready()
    async with cluster.client() as c:
        sbs = await c.create(count=4, backend="fncall")
        on_a = next(sb for sb in sbs if sb.node == "a")
        call = asyncio.ensure_future(on_a.exec("sleep 60", timeout=60))
        await asyncio.sleep(1.0)
        t = time.monotonic()
        cluster.edges["a"].kill()
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(call, 30)
        assert time.monotonic() - t < 10
        for _ in range(50):  # the node is down; its sandboxes are being reported lost
            if (await c.get(on_a.id)).info.state == "lost":
                break
            await asyncio.sleep(0.1)
        assert (await c.get(on_a.id)).info.state == "lost"
        with pytest.raises(errors.SandboxLost):
            await on_a.exec("true")
        assert (await c.fncall("print('still serving')")).stdout == b"still serving\n"
        fresh = await c.create(count=2, backend="fncall")
        assert {sb.node for sb in fresh} == {"b"}
        await c.destroy(sbs + fresh)
    node_a = str(cluster.state_dir / "nodes" / "a")
    for _ in range(100):
        if not processes_mentioning(node_a):
            break
        await asyncio.sleep(0.1)
    assert not processes_mentioning(node_a), "the killed edge's supervisor or zygote leaked"


async def test_edge_restart_keeps_fncall_sandboxes(local_cluster):
    """A restart shorter than the node timeout loses nothing (10 s here: a loaded 2-core
    machine takes more than the other tests' 2 s to stop an edge and start another)."""
    cluster = local_cluster(ENV)
    cluster.start_apiserver("--node-timeout", "10")
    cluster.start_edge("a", ["fncall"])
    await cluster.ready()
    async with cluster.client() as c:
        [sb] = await c.create(count=1, backend="fncall")
        await sb.write_file("/tmp/kept", b"still here")
        cluster.edges["a"].stop()
        cluster.start_edge("a", ["fncall"])
        await cluster.ready()
        assert await sb.read_file("/tmp/kept") == b"still here"
        assert (await sb.exec("cat /tmp/kept")).stdout == b"still here"
        await c.destroy([sb])


def test_cli(cluster, tmp_path):
    cluster.start_edge("n1", ["fncall"])
    asyncio.run(cluster.ready())
    env = {
        **os.environ,
        "DSEC_URL": cluster.conn.url,
        "DSEC_TOKEN": cluster.conn.token,
        "COLUMNS": "200",
    }

    def dsec_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dsec_kernel.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    made = dsec_cli("create", "--count", "30", "--backend", "fncall")
    assert made.returncode == 0, made.stderr
    assert "creating 30 fncall" in made.stderr  # the progress bar; ids go to stdout
    ids = made.stdout.split()
    assert len(ids) == 30 and all(i.startswith("sb-") for i in ids)
    listed = dsec_cli("ls")
    assert listed.stdout.count("sb-") == 30
    ran = dsec_cli("exec", ids[0], "--", "sh", "-c", "echo hi; exit 4")
    assert (ran.stdout, ran.returncode) == ("hi\n", 4)
    assert dsec_cli("fncall", "print(2+2)").stdout == "4\n"
    assert "n1" in dsec_cli("nodes").stdout
    gone = dsec_cli("destroy", "--all")
    assert "destroyed 30" in gone.stdout
    bad = dsec_cli("create", "--backend", "nope")
    assert bad.returncode == errors.UnknownBackend.exit_status and "unknown_backend" in bad.stderr


def test_dsec_up_runs_the_quickstart(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsec_kernel.cli",
            "up",
            "--state-dir",
            str(tmp_path / "up"),
            "--",
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fncall: 42" in proc.stdout and "destroyed; left: 0" in proc.stdout
    assert "dsec: stopped" in proc.stderr
    assert not (tmp_path / "up" / "connection.json").exists()  # removed at the stop
    assert not processes_mentioning(str(tmp_path / "up"))


def test_dsec_up_stops_cleanly_on_sigterm(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec_kernel.cli", "up", "--state-dir", str(tmp_path / "up")],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if "press Ctrl-C" in line:
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert "stopped" in proc.stderr.read()
    proc.stderr.close()
    assert not processes_mentioning(str(tmp_path / "up"))


async def test_services_stop_on_sigterm_even_when_nats_is_gone(cluster):
    """An apiserver or edge whose NATS died still stops when told to (it used to wait for
    ever for the server to confirm its unsubscriptions)."""
    cluster.start_edge("n1", ["fncall"])
    await cluster.ready()
    cluster.nats.proc.kill()
    cluster.nats.proc.wait()
    children = [cluster.apiservers[0], cluster.edges["n1"]]
    for child in children:
        child.proc.send_signal(signal.SIGTERM)
    for child in children:
        assert await asyncio.to_thread(child.proc.wait, 20) == 0, child.name
