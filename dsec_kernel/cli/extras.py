"""What the ``dsec`` commands that run DSec's services need beyond the SDK: the kernel's
``server`` extra (``pip install 'dsec-kernel[server]'``: the nats-server binary, bcrypt for
NATS logins, the agent protocol's gRPC). A trainer's plain ``pip install dsec-kernel`` lacks
it; those commands say so in one line instead of failing at an import."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SERVER_COMMANDS", "server_extra_hint"]

#: the commands that start services or reach the cluster's state as the operator
SERVER_COMMANDS = frozenset({"up", "down", "cluster-up", "apiserver", "edge", "tenant"})

_SERVER_MARKER = re.compile(r"""extra\s*==\s*["']server["']""")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _missing() -> list[str]:
    """The distributions of dsec-kernel's ``server`` extra that are not installed, as its
    metadata names them; none when the kernel runs from a checkout that was never installed
    (no metadata to read)."""
    try:
        requires = metadata.requires("dsec-kernel") or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requires:
        name = _NAME.match(requirement)
        if name is None or not _SERVER_MARKER.search(requirement):
            continue
        try:
            metadata.distribution(name.group())
        except metadata.PackageNotFoundError:
            missing.append(name.group())
    return missing


def server_extra_hint(command: str) -> str | None:
    """The line ``dsec COMMAND`` prints instead of running when the server extra is missing;
    None when it is installed (or ``command`` needs none of it)."""
    if command not in SERVER_COMMANDS:
        return None
    missing = _missing()
    if not missing:
        return None
    return (
        f"`dsec {command}` needs DSec's server side, not installed here ({', '.join(missing)} "
        "missing): pip install 'dsec-kernel[server]'"
    )
