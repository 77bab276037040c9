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

from dsec_kernel import errors
from dsec_kernel.cluster import LocalCluster, ensure_tenant
from dsec_kernel.config import default_node_name, default_state_dir
from dsec_kernel.connection import Connection, connection_file, write_connection

__all__ = ["up"]


def _say(msg: str) -> None:
    print(f"dsec up: {msg}", file=sys.stderr, flush=True)


def _old_token(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["token"]
    except (OSError, ValueError, KeyError):
        return None


def up(
    state_dir: Path | None,
    port: int,
    node: str | None,
    backends: list[str] | None,
    command: list[str],
    ready_timeout: float = 90.0,
) -> int:
    state_dir = (state_dir or default_state_dir()).resolve()
    node = node or default_node_name()
    stop_requested = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(state_dir, {"DSEC_STATE_DIR": str(state_dir)})
    cluster.nats.port = port
    try:
        cluster.start_nats()
        conn_path = connection_file(state_dir)
        conn = asyncio.run(
            ensure_tenant(cluster.url, "default", _old_token(conn_path), cluster.nats.client_url)
        )
        cluster.conn = conn
        cluster.start_apiserver()
        cluster.start_edge(node, backends)
        _say(f"starting on NATS 127.0.0.1:{cluster.nats.port} ...")
        asyncio.run(cluster.ready(ready_timeout))
        write_connection(conn_path, conn)
        write_connection(state_dir / "service.json", Connection(cluster.url, "", "operator"))
        _say(f"ready: tenant {conn.tenant!r}, node {node!r}; logs in {cluster.logs}")
        _say(f"connection file {conn_path}")
        if state_dir != default_state_dir().resolve():
            _say(f"other shells: export DSEC_STATE_DIR={state_dir}")
        children = [*cluster.apiservers, *cluster.edges.values()]
        if command:
            env = {
                **os.environ,
                "DSEC_URL": conn.url,
                "DSEC_TOKEN": conn.token,
                "DSEC_STATE_DIR": str(state_dir),
            }
            proc = subprocess.Popen(command, env=env)
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
        cluster.stop()
        for s, h in old.items():
            signal.signal(s, h)
        _say("stopped")
