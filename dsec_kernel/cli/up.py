"""``dsec up``: the single-machine default in one command; ``dsec cluster-up``: a real
cluster on one machine.

``up`` starts an embedded nats-server with JetStream, one apiserver and one edge (each its
own process); ``cluster-up`` a NATS cluster (JetStream replicated), several apiservers and
several edges, each edge in its own network namespace. Both write the connection file (the
client URL and the default tenant's token) and the service file (the URL and the path of the
service login, for operator commands), and stop everything on Ctrl-C / SIGTERM — or, given a
command after ``--``, run it against the platform and stop when it exits; then they remove
both files. Tenant logins follow the tenants bucket while they run.

One state directory serves one platform at a time: a second ``up`` on it is refused with the
first's pid and URL (an ``flock`` on ``<state>/up.lock``, released by the kernel however the
first ends). Sandboxes outlive the platform (the next ``up`` adopts them): at its stop ``up``
says what stays and how to remove it, or removes everything first with ``--rm``, or when
``dsec down`` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dsec_kernel.cli import exitcodes, leftovers
from dsec_kernel.cluster import LocalCluster, ensure_tenant
from dsec_kernel.config import default_node_name, default_state_dir
from dsec_kernel.connection import (
    connection_file,
    remove_written,
    service_file,
    write_connection,
    write_private,
    write_service,
)
from dsec_kernel.contract import errors
from dsec_kernel.loader import default_backend

__all__ = ["cluster_up", "down", "up"]

#: the default tenant's token, kept across runs
TOKEN_FILE = "default.token"
#: left by ``dsec down`` for the ``up`` it stops: remove every sandbox first
DOWN_FILE = "down.request"
LOCK_FILE = "up.lock"


def _say(msg: str) -> None:
    print(f"dsec: {msg}", file=sys.stderr, flush=True)


def _old_token(state_dir: Path) -> str | None:
    """The default tenant's token of an earlier run (kept in ``default.token``, which stays
    when the connection file is removed, so restarts reuse one credential)."""
    try:
        return (state_dir / TOKEN_FILE).read_text().strip() or None
    except OSError:
        pass
    try:  # written before the token had a file of its own
        return json.loads(connection_file(state_dir).read_text())["token"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _lock_state_dir(state_dir: Path) -> int:
    """Hold ``<state_dir>/up.lock`` for this process's life; Conflict naming the holder if
    another ``dsec up`` holds it. Returns the lock's fd (kept open: closing releases it)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        at = f" at {holder['url']}" if holder.get("url") else ""
        raise errors.Conflict(
            f"dsec up (pid {holder.get('pid', '?')}) already runs with {state_dir}{at}: use "
            "that one, stop it, or give this one a --state-dir of its own",
            retryable=False,
        ) from None
    _note_holder(fd, None)
    return fd


def _note_holder(fd: int, url: str | None) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "url": url}).encode(), 0)


def up(
    state_dir: Path | None,
    port: int,
    node: str | None,
    backends: list[str] | None,
    command: list[str],
    remove: bool = False,
    ready_timeout: float = 90.0,
) -> int:
    """One nats-server, one apiserver, one edge."""
    state_dir = (state_dir or default_state_dir()).resolve()
    node = node or default_node_name()
    cluster = LocalCluster(state_dir, {"DSEC_STATE_DIR": str(state_dir)})
    cluster.nats.port = port  # type: ignore[union-attr]
    cluster.env["DSEC_DEFAULT_BACKEND"] = default_backend(backends)

    def start() -> str:
        cluster.start_apiserver()
        cluster.start_edge(node, backends)
        return f"node {node!r}"

    return _run(cluster, state_dir, start, command, remove, ready_timeout)


def cluster_up(
    state_dir: Path | None,
    nats_servers: int,
    apiservers: int,
    edges: int,
    cloud: int,
    backends: list[str] | None,
    command: list[str],
    remove: bool = False,
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
    cluster.env["DSEC_DEFAULT_BACKEND"] = default_backend(backends)

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

    return _run(cluster, state_dir, start, command, remove, ready_timeout)


def down(state_dir: Path | None, keep: bool, timeout: float = 120.0) -> int:
    """Stop the ``dsec up`` of ``state_dir``, which first removes every sandbox (unless
    ``keep``); returns once it has stopped."""
    state_dir = (state_dir or default_state_dir()).resolve()
    try:
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    try:
        if fd is None or _try_lock(fd):
            raise errors.NotFound(f"no dsec up runs with {state_dir}; nothing to stop")
        pid = _holder_pid(fd, state_dir)
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None
        try:  # the number is the holder's still (not reused by now): it holds the lock and
            # the file still names it, checked after the pidfd pins the process
            if pidfd is None or _try_lock(fd) or _holder_pid(fd, state_dir) != pid:
                raise errors.Conflict(f"dsec up (pid {pid}) stopped meanwhile; try again")
            marker = state_dir / DOWN_FILE
            if not keep:
                marker.write_text(str(pid))
            with contextlib.suppress(ProcessLookupError):  # it ended just now: done
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        _say(f"stopping dsec up (pid {pid}){'' if keep else ', removing every sandbox'} ...")
        deadline = time.monotonic() + timeout
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                raise errors.DeadlineExceeded(
                    f"dsec up (pid {pid}) did not stop within {timeout:g}s; its logs are in "
                    f"{state_dir / 'logs'}"
                )
            time.sleep(0.2)
        marker.unlink(missing_ok=True)
        _say("stopped")
        return 0
    finally:
        if fd is not None:
            os.close(fd)


def _holder_pid(fd: int, state_dir: Path) -> int:
    try:
        return int(json.loads(os.pread(fd, 4096, 0))["pid"])
    except (ValueError, KeyError, TypeError):
        raise errors.Unavailable(f"{state_dir / LOCK_FILE} names no pid; stop it by hand") from None


def _try_lock(fd: int) -> bool:
    """Take the lock if free (then let it go at once): whether no ``up`` holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _wind_down(admin_url: str, state_dir: Path, remove: bool) -> None:
    """Remove every sandbox (``remove``, or asked by ``dsec down``), or say what stays."""
    marker = state_dir / DOWN_FILE
    if marker.exists():
        remove = True
        marker.unlink(missing_ok=True)
    try:
        if remove:
            _say(f"removed {asyncio.run(leftovers.remove_all(admin_url))} sandbox(es)")
            return
        counts = asyncio.run(leftovers.scan(admin_url))
    except errors.DsecError as exc:
        _say(f"could not {'remove' if remove else 'list'} the sandboxes left: {exc.message}")
        return
    if counts:
        _say(
            f"{leftovers.describe(counts)} stay in {state_dir}, and the next dsec up adopts "
            "them; to remove them run `dsec destroy --all` while it runs, stop it with `dsec "
            "down`, or start it with --rm"
        )


def _run(
    cluster: LocalCluster,
    state_dir: Path,
    start: Callable[[], str],
    command: list[str],
    remove: bool,
    ready_timeout: float,
) -> int:
    """Start ``cluster``, write the connection file, then run ``command`` against it (or wait
    for Ctrl-C / SIGTERM), and stop everything: first removing every sandbox if ``remove``,
    else saying what stays."""
    stop_requested = False
    ready = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    try:
        lock = _lock_state_dir(state_dir)
    except errors.DsecError as exc:
        _say(f"error: {exc.message}")
        return exitcodes.for_error(exc)
    conn_path, serv_path = connection_file(state_dir), service_file(state_dir)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start_nats()
        _note_holder(lock, cluster.nats.client_url)
        conn = asyncio.run(
            ensure_tenant(
                cluster.url,
                "default",
                _old_token(state_dir),
                cluster.nats.client_url,
                replicas=cluster.kv_replicas,
            )
        )
        cluster.conn = conn
        write_private(state_dir / TOKEN_FILE, conn.token)
        what = start()
        _say(f"starting {what} ...")
        asyncio.run(cluster.ready(ready_timeout))
        ready = True
        write_connection(conn_path, conn)
        write_service(serv_path, cluster.nats.client_url, cluster.nats.login_file)
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
        return exitcodes.for_error(exc)
    finally:
        remove_written(conn_path, serv_path)  # nothing left pointing at a dead port
        if ready:
            _wind_down(cluster.url, state_dir, remove)
        cluster.stop()
        for s, h in old.items():
            signal.signal(s, h)
        os.close(lock)
        _say("stopped")
