"""Running DSec on this machine: what ``dsec up``, ``dsec cluster-up``, the tests and the
benchmarks share.

:class:`LocalCluster` starts a real nats-server (JetStream, free port) or a cluster of them,
apiservers and edges, each its own process, and can kill and restart any of them; with
``netns`` each edge runs in its own network namespace, as if on its own machine. Third-party
plugins can use it to test against a real platform.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from dsec_kernel import bus
from dsec_kernel.connection import Connection
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import NodeInfo, NodesRequest, NodesResponse, Quota
from dsec_kernel.linuxhost.nodenet import NodeNetwork
from dsec_kernel.linuxhost.procs import die_with_parent, stop_process
from dsec_kernel.loader import default_backend
from dsec_kernel.natscluster import NatsCluster
from dsec_kernel.natsserver import NatsServer
from dsec_kernel.sdk import AsyncClient
from dsec_kernel.state.facade import ClusterState

__all__ = ["Child", "LocalCluster", "ensure_tenant", "wait_ready"]

_DSEC = [sys.executable, "-m", "dsec_kernel.cli"]


class Child:
    """A DSec service process whose output goes to a log file; dies with its parent."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as f:
            self.log_start = f.tell()  # what earlier runs wrote there is not this one's
            self.proc = subprocess.Popen(
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """Raise Unavailable, with the end of its log, if the process has exited."""
        if self.proc.poll() is not None:
            with open(self.log, "rb") as f:
                f.seek(self.log_start)
                tail = f.read().decode(errors="replace").splitlines()[-15:]
            raise errors.Unavailable(
                f"{self.name} exited with status {self.proc.returncode}; last lines of "
                f"{self.log}:\n  " + "\n  ".join(tail)
            )

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. Idempotent."""
        stop_process(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def ensure_tenant(
    admin_url: str,
    name: str,
    reuse_token: str | None = None,
    client_url: str | None = None,
    *,
    replicas: int = 1,
    wait_s: float = 10.0,
) -> Connection:
    """A credential for tenant ``name`` (``reuse_token`` if the cluster still knows it), made
    through ``admin_url`` (with the service login), for clients connecting to ``client_url``
    (default: ``admin_url`` without its credentials). Missing buckets are made with
    ``replicas`` copies. Returns once every NATS server accepts the credential's login;
    Unauthenticated if that takes longer than ``wait_s`` (nothing loads logins into them)."""
    url = client_url or ",".join(bus.server_urls(admin_url))
    nc = await bus.connect(admin_url, name="dsec-admin")
    try:
        state = await ClusterState.open(nc, replicas=replicas)
        tenant = await state.adopt_tenant(reuse_token) if reuse_token else None
        if reuse_token and tenant is not None:
            token = reuse_token
        else:
            token, tenant = await state.create_tenant(name), name
    finally:
        await nc.drain()
    await bus.wait_accepted(url, bus.Login.for_token(token), wait_s)
    return Connection(url, token, tenant)


async def wait_ready(
    conn: Connection,
    nodes: Iterable[str],
    children: Iterable[Child] = (),
    timeout: float = 60.0,
    since: float = 0.0,
) -> list[NodeInfo]:
    """Until an apiserver answers and lists every node in ``nodes`` up with a backend and a
    heartbeat newer than ``since`` (a time.time()).

    Raises Unavailable if a child exits meanwhile or ``timeout`` passes, saying what was
    last seen missing (no apiserver answered, or which node is not ready and why).
    """
    want = set(nodes)
    children = list(children)
    nc = await bus.connect(conn.url, name="dsec-wait", login=bus.Login.for_token(conn.token))
    deadline = time.monotonic() + timeout
    missing = "no apiserver has answered yet"
    try:
        while True:
            for c in children:
                c.check()
            try:
                resp = await bus.request(
                    nc,
                    bus.api_subject("nodes"),
                    NodesRequest(),
                    NodesResponse,
                    timeout=2,
                    headers={bus.TOKEN_HEADER: conn.token},
                )
                missing = _not_ready(want, resp.nodes, since)
                if not missing:
                    return resp.nodes
            except errors.DsecError as exc:
                missing = f"no apiserver answered ({exc})"
            if time.monotonic() > deadline:
                logs = ", ".join(str(c.log) for c in children if hasattr(c, "log"))
                raise errors.Unavailable(
                    f"the platform was not ready within {timeout:.0f}s: {missing}"
                    + (f"; see {logs}" if logs else "")
                )
            await asyncio.sleep(0.05)
    finally:
        await nc.drain()


def _not_ready(want: set[str], nodes: list[NodeInfo], since: float) -> str:
    """Why the nodes ``want`` are not all ready in ``nodes`` ("" if they are)."""
    seen = {n.node: n for n in nodes}
    why = []
    for name in sorted(want):
        n = seen.get(name)
        if n is None:
            why.append(f"node {name} has no record (its edge has not written a heartbeat)")
        elif n.heartbeat_at < since:
            why.append(
                f"node {name}'s record is from before its edge started (its last heartbeat, "
                f"{since - n.heartbeat_at:.0f}s earlier, was an older edge's)"
            )
        elif n.state != "up":
            why.append(f"node {name} is marked {n.state} by the apiserver")
        elif n.stopping_since is not None:
            why.append(f"node {name}'s edge says it is stopping")
        elif not n.backends:
            why.append(f"node {name} serves no backend")
    return "; ".join(why)


class LocalCluster:
    """nats-server(s) + apiservers + edges on this machine, each a process.

    ``env`` adds ``DSEC_*`` settings for every service (e.g. fncall pool size).
    ``nats_servers`` > 1 makes a NATS cluster with KV and streams replicated on up to three
    of them. ``netns`` puts each edge in a network namespace of its own, reaching NATS over a
    bridge (the servers listen on the bridge's address). The services get the NATS address
    and the path of the service login file, never the password (a process they start, a
    sandbox's init included, inherits nothing secret); tenant logins follow the tenants
    bucket (:class:`~dsec_kernel.natsserver.LoginSync`).
    """

    def __init__(
        self,
        state_dir: Path,
        env: dict[str, str] | None = None,
        *,
        nats_servers: int = 1,
        netns: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.logs = self.state_dir / "logs"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.network = NodeNetwork(self.state_dir / "netns") if netns else None
        host = self.network.host if self.network else "127.0.0.1"
        self.nats: NatsServer | NatsCluster
        if nats_servers > 1:
            self.nats = NatsCluster(self.state_dir / "nats", nats_servers, host)
            self.env.setdefault("DSEC_KV_REPLICAS", str(min(3, nats_servers)))
        else:
            self.nats = NatsServer(self.state_dir / "nats", host=host)
        self.apiservers: list[Child] = []
        self.edges: dict[str, Child] = {}
        self._egress: dict[str, dict[str, str]] = {}  # node -> its egress settings
        self.started: dict[str, float] = {}
        self.conn: Connection | None = None

    @property
    def url(self) -> str:
        """The service URL, with its password: for operator work inside this process only."""
        return self.nats.service_url

    @property
    def kv_replicas(self) -> int:
        """Copies of each KV bucket (``DSEC_KV_REPLICAS`` of the services)."""
        return int(self.env.get("DSEC_KV_REPLICAS", "1"))

    def client(self, **kw: object) -> AsyncClient:
        """An SDK client of the default tenant (after :meth:`ready`); ``kw`` as AsyncClient's."""
        if self.conn is None:
            raise errors.Unavailable("the cluster is not ready: await ready() first")
        return AsyncClient(url=self.conn.url, token=self.conn.token, **kw)  # type: ignore[arg-type]

    def start_nats(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.network is not None and not self.network.started:
            self.network.start()
        self.nats.start()
        self.env["DSEC_NATS_URL"] = self.nats.client_url
        self.env["DSEC_NATS_LOGIN_FILE"] = str(self.nats.login_file)

    def start_apiserver(self, *args: str) -> Child:
        """Start an apiserver; the cluster's default backend is ``DSEC_DEFAULT_BACKEND`` of
        ``env``, else the one :func:`~dsec_kernel.loader.default_backend` picks."""
        if "DSEC_DEFAULT_BACKEND" not in self.env:
            self.env["DSEC_DEFAULT_BACKEND"] = default_backend()
        i = len(self.apiservers)
        child = Child(
            f"apiserver-{i}",
            [*_DSEC, "apiserver", *args],
            self.logs / f"apiserver-{i}.log",
            self.env,
        )
        self.apiservers.append(child)
        return child

    def start_edge(self, node: str, backends: Iterable[str] | None = None, *args: str) -> Child:
        argv = [*_DSEC, "edge", "--node", node, "--state-dir", str(self.state_dir / "nodes" / node)]
        if backends:
            argv += ["--backends", ",".join(backends)]
        if self.network is not None:
            argv = self.network.wrap(node, argv)
        env = self.env | self._egress.setdefault(node, self._egress_env())
        child = Child(f"edge {node}", [*argv, *args], self.logs / f"edge-{node}.log", env)
        self.edges[node] = child
        self.started[node] = time.time()
        return child

    def _egress_env(self) -> dict[str, str]:
        """Edges sharing the host's network (no ``netns``) each get their own egress
        addresses and rules (from the second on; the first keeps the defaults); the
        caller's settings win."""
        i = len(self._egress)
        if self.network is not None or i == 0:
            return {}
        own = {"SUBNET": f"10.{213 + i // 16}.{i % 16 * 16}.0/20", "NAME": f"dsec{i}"}
        env = {f"DSEC_BACKEND_CONFIG__CONTAINER__EGRESS_{k}": v for k, v in own.items()}
        return {k: v for k, v in env.items() if k not in self.env}

    async def tenant_client(self, name: str, **kw: object) -> AsyncClient:
        """An SDK client with a new credential for tenant ``name`` (from a running event
        loop; :meth:`tenant` from outside one); ``kw`` as AsyncClient's."""
        conn = await ensure_tenant(
            self.url, name, client_url=self.nats.client_url, replicas=self.kv_replicas
        )
        return AsyncClient(url=conn.url, token=conn.token, **kw)  # type: ignore[arg-type]

    async def set_quota(self, tenant: str, quota: Quota) -> None:
        """Give ``tenant`` ``quota``, as ``dsec tenant quota`` does (apiservers read it at
        each create)."""
        nc = await bus.connect(self.url, name="operator")
        try:
            state = await ClusterState.open(nc)
            await state.put_quota(tenant, quota)
        finally:
            await nc.close()

    def tenant(self, name: str = "default") -> Connection:
        """A new credential for tenant ``name``."""
        return asyncio.run(
            ensure_tenant(
                self.url, name, client_url=self.nats.client_url, replicas=self.kv_replicas
            )
        )

    async def ready(self, timeout: float = 60.0) -> list[NodeInfo]:
        """Wait until every started edge is up (a default tenant is created on first use)."""
        if self.conn is None:
            self.conn = await ensure_tenant(
                self.url, "default", client_url=self.nats.client_url, replicas=self.kv_replicas
            )
        children = [*self.apiservers, *(c for c in self.edges.values() if c.alive())]
        nodes = [n for n, c in self.edges.items() if c.alive()]
        since = min((self.started[n] for n in nodes), default=0.0)
        return await wait_ready(self.conn, nodes, children, timeout, since)

    def stop(self) -> None:
        for child in [*self.edges.values(), *self.apiservers]:
            child.stop()
        self.nats.stop()
        if self.network is not None:
            self.network.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
