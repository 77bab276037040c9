"""Where the SDK and CLI find the cluster: explicit arguments, ``DSEC_URL`` / ``DSEC_TOKEN``,
or the connection file that ``dsec up`` writes (``$DSEC_STATE_DIR/connection.json``,
default ``~/.dsec/connection.json``); and where operator commands find the service login
(``service.json`` beside it).

The URL carries no credential: the SDK logs in to NATS with the token (see
:meth:`dsec_kernel.bus.Login.for_token`).

Both files name the ``dsec up`` that wrote them (its pid, host and PID namespace), which
removes them when it stops. A file whose writer is no longer running on this host is stale:
using it fails at once with a line that says so, instead of waiting on a dead port.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec_kernel.config import default_state_dir
from dsec_kernel.contract import errors

__all__ = [
    "Connection",
    "connection_file",
    "read_service",
    "remove_written",
    "resolve",
    "service_file",
    "write_connection",
    "write_private",
    "write_service",
]


@dataclass(frozen=True)
class Connection:
    url: str
    token: str
    tenant: str = ""


def connection_file(state_dir: Path | None = None) -> Path:
    return (state_dir or default_state_dir()) / "connection.json"


def service_file(state_dir: Path | None = None) -> Path:
    """Where ``dsec up`` tells operator commands the NATS URL and the service login's file."""
    return (state_dir or default_state_dir()) / "service.json"


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def _writer() -> dict[str, object]:
    """Who is writing: this process, on this host, in this PID namespace."""
    return {"pid": os.getpid(), "host": os.uname().nodename, "pidns": _pidns()}


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _writer_gone(data: dict) -> int | None:
    """The pid of the ``dsec up`` that wrote ``data`` if it is known not to run any more
    (same host and PID namespace, and no process of that pid runs dsec); else None."""
    pid = data.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None  # written by hand, or by an older dsec: nothing to judge by
    if data.get("host") != os.uname().nodename or data.get("pidns") != _pidns():
        return None  # another machine's or container's: its pids are not ours to look at
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid
    return None if b"dsec" in cmdline else pid  # a reused pid is not the writer


def _shown(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


def _check_fresh(path: Path, data: dict) -> None:
    if (pid := _writer_gone(data)) is not None:
        raise errors.Unavailable(
            f"no DSec at {data.get('url')} (from {_shown(path)}, written by dsec up pid {pid}, "
            "which is not running): start it with `dsec up`",
            retryable=False,
        )


def write_connection(path: Path, conn: Connection) -> None:
    """Write the file readable by its owner only (it holds a credential)."""
    write_private(path, json.dumps({**asdict(conn), **_writer()}))


def write_service(path: Path, url: str, login_file: Path) -> None:
    """Write the service file: ``url`` (no credential) and the path of the login file."""
    write_private(path, json.dumps({"url": url, "login_file": str(login_file), **_writer()}))


def remove_written(*paths: Path) -> None:
    """Remove those of ``paths`` that this process wrote (another's are left alone)."""
    for path in paths:
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError, AttributeError):
            pass


def read_service(path: Path) -> tuple[str, Path]:
    """The NATS URL and the service login file that ``dsec up`` wrote to ``path``;
    Unavailable at once if the ``dsec up`` that wrote it is not running."""
    try:
        data = json.loads(path.read_text())
        url, login_file = data["url"], Path(data["login_file"])
    except (OSError, ValueError, KeyError, TypeError):
        raise errors.InvalidArgument(
            f"pass --nats-url and --nats-login-file (the service login): {path}, which "
            "`dsec up` writes, is not readable"
        ) from None
    _check_fresh(path, data)
    return url, login_file


def resolve(url: str | None = None, token: str | None = None) -> Connection:
    """The connection to use; arguments win over the environment, which wins over the file."""
    url = url or os.environ.get("DSEC_URL")
    token = token or os.environ.get("DSEC_TOKEN")
    if url and token:
        return Connection(url, token)
    path = connection_file()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise errors.Unauthenticated(
            f"no DSec connection: pass url= and token=, set DSEC_URL and DSEC_TOKEN, or run "
            f"`dsec up` (it writes {path})"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise errors.Unauthenticated(f"cannot read the connection file {path}: {exc}") from None
    if not url:
        _check_fresh(path, data)
    return Connection(url or data["url"], token or data["token"], data.get("tenant", ""))
