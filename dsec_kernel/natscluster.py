"""A NATS cluster of several embedded ``nats-server`` processes (JetStream replicated).

Every server has the same two users (see :class:`~dsec_kernel.natsserver.NatsServer`) and
routes to the others; URLs list every server (``nats://...,nats://...``) so clients fail
over when one goes.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

from dsec_kernel import errors
from dsec_kernel.natsserver import NatsServer

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
                config=block,
            )  # fmt: skip
            self.servers.append(server)

    def _urls(self, which: str) -> str:
        return ",".join(getattr(s, which) for s in self.servers)

    @property
    def service_url(self) -> str:
        return self._urls("service_url")

    @property
    def client_url(self) -> str:
        return self._urls("client_url")

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every server with the first one's credentials; returns once all listen."""
        first = self.servers[0]
        first.store_dir.mkdir(parents=True, exist_ok=True)
        first._load_passwords()
        for s in self.servers[1:]:
            s.store_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(first.store_dir / "auth.json", s.store_dir / "auth.json")
        deadline = time.monotonic() + timeout
        try:
            for s in self.servers:
                s.start(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
