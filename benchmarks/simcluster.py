"""What the control-plane benchmarks share: nats-server, an apiserver and simulated edges
(``sim_edges.py``, the noop backend), each a process, started and ready."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsec_kernel.cluster import Child, ensure_tenant, wait_ready
from dsec_kernel.connection import Connection
from dsec_kernel.natsserver import NatsServer

HERE = Path(__file__).resolve().parent


@dataclass
class SimCluster:
    tmp: Path
    nats: NatsServer
    env: dict[str, str]
    api: Child
    sim: subprocess.Popen[str]
    conn: Connection
    nodes: list[str]

    def restart_apiserver(self) -> None:
        """Stop the apiserver and start a fresh one (wait for it with :meth:`ready`)."""
        self.api.stop()
        self.api = _apiserver(self.tmp, self.env, f"apiserver-{self.api.proc.pid}")

    async def ready(self, timeout: float = 60.0) -> None:
        await wait_ready(self.conn, self.nodes, [self.api], timeout=timeout)


def _apiserver(tmp: Path, env: dict[str, str], name: str) -> Child:
    argv = [sys.executable, "-m", "dsec_kernel.cli", "apiserver"]
    return Child(name, argv, tmp / f"{name}.log", env)


@contextmanager
def simulated(edges: int, max_per_edge: int | None = None) -> Iterator[SimCluster]:
    """A running cluster of ``edges`` simulated nodes (each holding at most
    ``max_per_edge`` sandboxes), and tenant ``bench``'s credential."""
    with (
        tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp,
        NatsServer(Path(tmp) / "nats") as nats,
    ):
        # the service login by file, never in an environment or on a command line
        env = {
            **os.environ,
            "DSEC_NATS_URL": nats.client_url,
            "DSEC_NATS_LOGIN_FILE": str(nats.login_file),
        }
        api = _apiserver(Path(tmp), env, "apiserver")
        sim_env = dict(env)
        if max_per_edge is not None:
            sim_env["DSEC_BACKEND_CONFIG__NOOP__MAX_SANDBOXES"] = str(max_per_edge)
        sim = subprocess.Popen(
            [sys.executable, str(HERE / "sim_edges.py"), nats.client_url, str(edges)],
            stdout=subprocess.PIPE,
            text=True,
            env=sim_env,
        )
        cluster: SimCluster | None = None
        try:
            assert sim.stdout is not None
            assert sim.stdout.readline().strip() == "ready", "simulated edges did not start"
            conn = asyncio.run(ensure_tenant(nats.service_url, "bench", client_url=nats.client_url))
            cluster = SimCluster(
                Path(tmp), nats, env, api, sim, conn, [f"sim{i:03d}" for i in range(edges)]
            )
            asyncio.run(cluster.ready())
            yield cluster
        finally:
            sim.terminate()
            sim.wait(60)
            if sim.stdout is not None:
                sim.stdout.close()
            (cluster.api if cluster is not None else api).stop()
