"""``dsec up``: the single-machine default in one command.

Starts an embedded nats-server with JetStream, one apiserver and one edge (each its own
process), writes the connection file, and stops everything on Ctrl-C / SIGTERM — or, given a
command after ``--``, runs it against the platform and stops when it exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsec_kernel import bus, errors
from dsec_kernel.config import default_node_name, default_state_dir
from dsec_kernel.connection import Connection, connection_file, write_connection
from dsec_kernel.natsserver import NatsServer
from dsec_kernel.procs import die_with_parent
from dsec_kernel.state import ClusterState, token_key
from dsec_kernel.wire import NodesRequest, NodesResponse

__all__ = ["up"]

DEFAULT_TENANT = "default"


def _say(msg: str) -> None:
    print(f"dsec up: {msg}", file=sys.stderr, flush=True)


async def _ensure_tenant(url: str, conn_path: Path) -> Connection:
    """Reuse the credential in the connection file if the cluster still knows it."""
    nc = await bus.connect(url, name="dsec-up")
    try:
        state = await ClusterState.open(nc)
        try:
            old = json.loads(conn_path.read_text())
            entry = await state.tenants.get(token_key(old["token"]))
            return Connection(url, old["token"], json.loads(entry.value)["tenant"])
        except Exception:
            token = await state.create_tenant(DEFAULT_TENANT)
            return Connection(url, token, DEFAULT_TENANT)
    finally:
        await nc.drain()


async def _wait_ready(conn: Connection, node: str, procs: list[_Child], timeout: float) -> None:
    """Until the apiserver answers and lists our edge's node as up with a backend."""
    nc = await bus.connect(conn.url, name="dsec-up")
    deadline = time.monotonic() + timeout
    try:
        while True:
            for p in procs:
                p.check()
            try:
                resp = await bus.request(
                    nc, bus.api_subject("nodes"), NodesRequest(), NodesResponse,
                    timeout=2, headers={bus.TOKEN_HEADER: conn.token},
                )
                if any(n.node == node and n.state == "up" and n.backends for n in resp.nodes):
                    return
            except errors.DsecError:
                pass
            if time.monotonic() > deadline:
                raise errors.Unavailable(f"the platform was not ready within {timeout:.0f}s")
            await asyncio.sleep(0.1)
    finally:
        await nc.drain()


class _Child:
    """A DSec service process with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, preexec_fn=die_with_parent,
            )

    def check(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace").splitlines()[-15:]
            raise errors.Unavailable(
                f"{self.name} exited with status {self.proc.returncode}; last lines of "
                f"{self.log}:\n  " + "\n  ".join(tail)
            )

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def up(
    state_dir: Path | None,
    port: int,
    node: str | None,
    backends: list[str] | None,
    command: list[str],
    ready_timeout: float = 60.0,
) -> int:
    state_dir = (state_dir or default_state_dir()).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    node = node or default_node_name()
    stop_requested = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    nats = NatsServer(state_dir / "nats", port=port)
    children: list[_Child] = []
    try:
        nats.start()
        conn_path = connection_file(state_dir)
        conn = asyncio.run(_ensure_tenant(nats.url, conn_path))
        env = {**os.environ, "DSEC_NATS_URL": nats.url, "PYTHONUNBUFFERED": "1"}
        py = [sys.executable, "-m", "dsec_kernel.cli"]
        children.append(_Child("apiserver", [*py, "apiserver"], logs / "apiserver.log", env))
        edge_argv = [*py, "edge", "--node", node, "--state-dir", str(state_dir)]
        if backends:
            edge_argv += ["--backends", ",".join(backends)]
        children.append(_Child("edge", edge_argv, logs / "edge.log", env))
        asyncio.run(_wait_ready(conn, node, children, ready_timeout))
        write_connection(conn_path, conn)
        _say(f"ready: NATS {nats.url}, tenant {conn.tenant!r}, node {node!r}")
        _say(f"connection file {conn_path} (logs in {logs})")
        if state_dir != default_state_dir().resolve():
            _say(f"clients: export DSEC_STATE_DIR={state_dir}")
        if command:
            cmd_env = {**os.environ, "DSEC_URL": conn.url, "DSEC_TOKEN": conn.token,
                       "DSEC_STATE_DIR": str(state_dir)}
            proc = subprocess.Popen(command, env=cmd_env)
            while proc.poll() is None:
                if stop_requested:
                    proc.terminate()
                for c in children:
                    c.check()
                time.sleep(0.1)
            return proc.returncode
        _say("press Ctrl-C to stop")
        while not stop_requested:
            for c in children:
                c.check()
            time.sleep(0.2)
        return 0
    except errors.DsecError as exc:
        _say(f"error: {exc.message}")
        return 1
    finally:
        for c in reversed(children):
            c.stop()
        nats.stop()
        for s, h in old.items():
            signal.signal(s, h)
        _say("stopped")
