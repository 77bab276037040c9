"""Tenants' credential records (KV ``dsec-tenants``) and their NATS passwords.

A record, under ``token_key(token)``: ``{"tenant": name, "created_at": t, "nats_password":
bcrypt(token)}``; the token itself is never stored.
"""

from __future__ import annotations

import json

import bcrypt

__all__ = ["BCRYPT_COST", "nats_password", "password_hash", "tenant_of"]

#: bcrypt's work factor for NATS passwords. The lowest: a token holds 256 random bits, so
#: slowness adds nothing against guessing, and nats-server checks the hash on every connect
#: (~1 ms at 4, ~80 ms at 10: a flood of logins would cost the server that much each).
BCRYPT_COST = 4


def password_hash(password: str) -> str:
    """The bcrypt hash nats-server checks ``password`` against."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()


def nats_password(record: bytes) -> str | None:
    """The NATS password hash in a tenants record (None: a credential made before tenants
    had NATS logins of their own; it has no login until its token is adopted again)."""
    value = json.loads(record).get("nats_password")
    return value if isinstance(value, str) else None


def tenant_of(record: bytes) -> str:
    """The tenant a credential record belongs to."""
    return json.loads(record)["tenant"]
