"""``dsec up``: the single-machine default in one command; ``dsec cluster-up``: a real
cluster on one machine.

``up`` starts an embedded nats-server with JetStream, one apiserver and one edge (each its
own process); ``cluster-up`` a NATS cluster (JetStream replicated), several apiservers and
several edges, each edge in its own network namespace. Both write the connection file (the
client URL and the default tenant's token) and the service file (the URL and the path of the
service login, for operator commands), and stop everything on Ctrl-C / SIGTERM — or, given a
command after ``--``, run it against the platform and stop when it exits. Tenant logins
follow the tenants bucket while they run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dsec_kernel import errors
from dsec_kernel.cluster import LocalCluster, ensure_tenant
from dsec_kernel.config import default_node_name, default_state_dir
from dsec_kernel.connection import connection_file, service_file, write_connection, write_service

__all__ = ["cluster_up", "up"]


def _say(msg: str) -> None:
    print(f"dsec: {msg}", file=sys.stderr, flush=True)


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
    """One nats-server, one apiserver, one edge."""
    state_dir = (state_dir or default_state_dir()).resolve()
    node = node or default_node_name()
    cluster = LocalCluster(state_dir, {"DSEC_STATE_DIR": str(state_dir)})
    cluster.nats.port = port  # type: ignore[union-attr]

    def start() -> str:
        cluster.start_apiserver()
        cluster.start_edge(node, backends)
        return f"node {node!r}"

    return _run(cluster, state_dir, start, command, ready_timeout)


def cluster_up(
    state_dir: Path | None,
    nats_servers: int,
    apiservers: int,
    edges: int,
    cloud: int,
    backends: list[str] | None,
    command: list[str],
    ready_timeout: float = 180.0,
) -> int:
    """A NATS cluster, several apiservers, and edges each in its own network namespace (the
    last ``cloud`` of them in node pool ``cloud``)."""
    state_dir = (state_dir or default_state_dir()).resolve()
    if not 0 <= cloud <= edges:
        raise errors.InvalidArgument(f"--cloud {cloud}: between 0 and --edges ({edges})")
    cluster = LocalCluster(
        state_dir, {"DSEC_STATE_DIR": str(state_dir)}, nats_servers=nats_servers, netns=True
    )

    def start() -> str:
        for _ in range(apiservers):
            cluster.start_apiserver()
        for i in range(1, edges + 1):
            pool = ["--pool", "cloud"] if i > edges - cloud else []
            cluster.start_edge(f"n{i}", backends, *pool)
        return (
            f"{nats_servers} NATS server(s), {apiservers} apiserver(s), nodes n1..n{edges} "
            f"({cloud} in pool cloud), each in its own network namespace"
        )

    return _run(cluster, state_dir, start, command, ready_timeout)


def _run(
    cluster: LocalCluster,
    state_dir: Path,
    start: Callable[[], str],
    command: list[str],
    ready_timeout: float,
) -> int:
    """Start ``cluster``, write the connection file, then run ``command`` against it (or wait
    for Ctrl-C / SIGTERM), and stop everything."""
    stop_requested = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start_nats()
        conn_path = connection_file(state_dir)
        conn = asyncio.run(
            ensure_tenant(
                cluster.url,
                "default",
                _old_token(conn_path),
                cluster.nats.client_url,
                replicas=cluster.kv_replicas,
            )
        )
        cluster.conn = conn
        what = start()
        _say(f"starting {what} ...")
        asyncio.run(cluster.ready(ready_timeout))
        write_connection(conn_path, conn)
        write_service(service_file(state_dir), cluster.nats.client_url, cluster.nats.login_file)
        _say(f"ready: tenant {conn.tenant!r}; logs in {cluster.logs}")
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
