"""A NATS cluster of several embedded ``nats-server`` processes (JetStream replicated).

Every server has the same logins (see :mod:`dsec_kernel.natsserver`): one service login file
for all, and the tenant logins that one :class:`~dsec_kernel.natsserver.LoginSync` keeps
equal to the tenants bucket on every server. Each routes to the others; URLs list every
server (``nats://...,nats://...``) so clients fail over when one goes.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.natsserver import LoginSync, NatsServer

__all__ = ["NatsCluster", "free_port"]


def free_port() -> int:
    """A TCP port free on every address now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NatsCluster:
    """``size`` servers on ``host``, state under ``root/nats-<i>``."""

    def __init__(self, root: Path, size: int = 3, host: str = "127.0.0.1") -> None:
        if size < 1:
            raise errors.InvalidArgument("a NATS cluster needs at least one server")
        self.root = Path(root)
        self.host = host
        routes = [free_port() for _ in range(size)]
        self.servers: list[NatsServer] = []
        for i, cport in enumerate(routes):
            others = [f"nats-route://{host}:{p}" for p in routes if p != cport]
            block = (
                f"cluster {{ name: dsec, listen: {json.dumps(f'{host}:{cport}')}, "
                f"routes: {json.dumps(others)} }}"
            )
            server = NatsServer(
                self.root / f"nats-{i}", port=free_port(), host=host, name=f"dsec-{i}",
                config=block, login_file=self.login_file, follow_tenants=False,
            )  # fmt: skip
            self.servers.append(server)
        self._sync: LoginSync | None = None

    @property
    def login_file(self) -> Path:
        """The service login every server shares (see :attr:`NatsServer.login_file`)."""
        return self.root / "service-login.json"

    @property
    def login(self) -> bus.Login:
        """The service login (after :meth:`start`)."""
        return self.servers[0].login

    @property
    def service_url(self) -> str:
        """Every server, with the service login: for use inside this process only."""
        return ",".join(s.service_url for s in self.servers)

    @property
    def client_url(self) -> str:
        """Every server, without a credential."""
        return ",".join(s.client_url for s in self.servers)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every server, then the login sync; returns once all listen."""
        deadline = time.monotonic() + timeout
        try:
            for s in self.servers:
                s.start(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self._sync = LoginSync(self.servers).start()
        return self

    def stop(self) -> None:
        if self._sync is not None:
            self._sync.stop()
            self._sync = None
        for s in self.servers:
            s.stop()
