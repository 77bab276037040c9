"""Where the SDK and CLI find the cluster: explicit arguments, ``DSEC_URL`` / ``DSEC_TOKEN``,
or the connection file that ``dsec up`` writes (``$DSEC_STATE_DIR/connection.json``,
default ``~/.dsec/connection.json``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec_kernel import errors
from dsec_kernel.config import default_state_dir

__all__ = ["Connection", "connection_file", "resolve", "write_connection"]


@dataclass(frozen=True)
class Connection:
    url: str
    token: str
    tenant: str = ""


def connection_file(state_dir: Path | None = None) -> Path:
    return (state_dir or default_state_dir()) / "connection.json"


def write_connection(path: Path, conn: Connection) -> None:
    """Write the file readable by its owner only (it holds a credential)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(conn), f)
    tmp.replace(path)


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
    return Connection(url or data["url"], token or data["token"], data.get("tenant", ""))
