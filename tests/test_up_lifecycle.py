"""``dsec up`` as a new user meets it: a stale connection file fails at once with one line,
one state directory serves one platform, and a stop says what stays or removes it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dsec_backend_fncall.backend import FncallBackend

import dsec_kernel as dsec
from dsec_kernel.cluster import wait_ready
from dsec_kernel.contract import errors

REASON = FncallBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
DSEC = [sys.executable, "-m", "dsec_kernel.cli"]


def cli(state: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_STATE_DIR": str(state), "COLUMNS": "200"}
    return subprocess.run([*DSEC, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def start_up(state: Path, *extra: str) -> tuple[subprocess.Popen[str], list[str]]:
    """A ``dsec up`` on ``state``, returned once it is ready, with the lines it said."""
    proc = subprocess.Popen(
        [*DSEC, "up", "--state-dir", str(state), "--backends", "fncall", *extra],
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DSEC_BACKEND_CONFIG__FNCALL__POOL_SIZE": "2"},
    )  # fmt: skip
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if "press Ctrl-C" in line:
            return proc, lines
    proc.wait()
    raise AssertionError("dsec up did not get ready:\n" + "".join(lines))


def finish(proc: subprocess.Popen[str], lines: list[str]) -> str:
    assert proc.stderr is not None
    rc = proc.wait(90)
    said = "".join(lines) + proc.stderr.read()
    proc.stderr.close()
    assert rc == 0, said
    return said


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_stale_connection_file_fails_at_once_in_one_line(tmp_path, monkeypatch):
    """What a stopped (or killed) ``dsec up`` left: the CLI and the SDK fail within seconds,
    naming the file and its dead writer, with no traceback."""
    stale = {"pid": dead_pid(), "host": os.uname().nodename,
             "pidns": os.readlink("/proc/self/ns/pid")}  # fmt: skip
    (tmp_path / "connection.json").write_text(
        json.dumps({"url": "nats://127.0.0.1:9", "token": "dsec_x", "tenant": "default", **stale})
    )
    (tmp_path / "service.json").write_text(
        json.dumps({"url": "nats://127.0.0.1:9", "login_file": "/nonexistent", **stale})
    )
    for args in (["nodes"], ["ls"], ["tenant", "create", "bob"]):
        t = time.monotonic()
        r = cli(tmp_path, *args)
        took = time.monotonic() - t
        assert r.returncode != 0 and took < 5, (args, took, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert f"written by dsec up pid {stale['pid']}, which is not running" in r.stderr
        assert "start it with `dsec up`" in r.stderr

    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path))
    with pytest.raises(errors.Unavailable, match="which is not running"):
        asyncio.run(dsec.AsyncClient().connect())


def test_one_state_dir_serves_one_up_and_down_removes_everything(tmp_path):
    state = tmp_path / "up"
    first, lines = start_up(state)
    conn = json.loads((state / "connection.json").read_text())
    assert (state / "connection.json").stat().st_mode & 0o777 == 0o600
    second = subprocess.run([*DSEC, "up", "--state-dir", str(state)], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert second.returncode == errors.Conflict.exit_status
    assert f"dsec up (pid {first.pid}) already runs with {state} at {conn['url']}" in second.stderr
    assert json.loads((state / "connection.json").read_text()) == conn  # not overwritten

    made = cli(state, "create", "--count", "2", "--backend", "fncall")
    assert made.returncode == 0, made.stderr
    down = cli(state, "down", timeout=120)
    assert down.returncode == 0, down.stderr
    said = finish(first, lines)
    assert "removed 2 sandbox(es)" in said
    assert not (state / "connection.json").exists() and not (state / "service.json").exists()
    assert "no dsec up runs" in cli(state, "down").stderr


def test_a_stop_says_what_stays_and_rm_removes_it(tmp_path):
    state = tmp_path / "up"
    proc, lines = start_up(state)
    assert cli(state, "create", "--backend", "fncall").returncode == 0
    proc.send_signal(signal.SIGINT)
    said = finish(proc, lines)
    assert f"1 sandbox (default: fncall 1) stay in {state}" in said, said
    assert "`dsec down`" in said and "--rm" in said

    proc, lines = start_up(state, "--rm")  # adopts it, and removes it at its stop
    assert cli(state, "ls").stdout.count("sb-") == 1
    proc.send_signal(signal.SIGTERM)
    assert "removed 1 sandbox(es)" in finish(proc, lines)


async def test_not_ready_says_which_node_and_why(local_cluster):
    """A platform that is not ready within the wait says what was missing, not only that."""
    cluster = local_cluster()
    cluster.start_apiserver()
    await cluster.ready()  # the apiserver answers; no edge yet
    with pytest.raises(errors.Unavailable) as caught:
        await wait_ready(cluster.conn, ["ghost"], cluster.apiservers, timeout=1)
    message = caught.value.message
    assert "not ready within 1s: node ghost has no record" in message, message
    assert str(cluster.apiservers[0].log) in message
