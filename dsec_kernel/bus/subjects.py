"""Where requests go and whose they are: subjects, the credential header, the names a
tenant credential has on NATS.

Subjects (all under ``dsec.``)::

    dsec.api.v1.<op>             apiserver endpoints   (queue group "apiserver")
    dsec.edge.<node>.v1.<op>     one node's edge       (queue group "edge")
"""

from __future__ import annotations

import hashlib

__all__ = [
    "TOKEN_HEADER",
    "api_subject",
    "edge_subject",
    "tenant_inbox",
    "tenant_user",
    "token_key",
]

#: the header a caller's credential (its token) travels in
TOKEN_HEADER = "Dsec-Token"


def api_subject(op: str) -> str:
    return f"dsec.api.v1.{op}"


def edge_subject(node: str, op: str) -> str:
    return f"dsec.edge.{node}.v1.{op}"


def token_key(token: str) -> str:
    """The KV key under which a tenant credential is stored (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()[:48]


def tenant_user(key: str) -> str:
    """The NATS user of the credential stored under ``key``."""
    return f"tenant-{key[:32]}"


def tenant_inbox(key: str) -> str:
    """The inbox prefix of that user: it may subscribe to nothing else."""
    return f"_I.{key[:32]}"
