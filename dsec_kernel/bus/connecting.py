"""Connections and logins: connecting to NATS (reconnecting for ever, unless the login is
removed), the service's and the tenants' logins, and disconnecting.

The services log in as the service user (:class:`Login`, from a file); each tenant credential
(a token) is a NATS user of its own, named after the token's key, that may publish only to
``dsec.api.v1.>`` and subscribe only below its inbox prefix ``_I.<id>``
(:meth:`Login.for_token`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nats.errors
from nats.aio.client import Client as NATS

from dsec_kernel.bus.subjects import tenant_inbox, tenant_user, token_key
from dsec_kernel.contract import errors

__all__ = [
    "PING_INTERVAL_S",
    "Login",
    "connect",
    "connect_service",
    "disconnect",
    "login_in_url",
    "server_urls",
    "wait_accepted",
]

log = logging.getLogger(__name__)

#: how often a connection pings its server (three unanswered: stale, reconnect)
PING_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Login:
    """A NATS user and password, and the inbox prefix its replies come to (None: ``_INBOX``)."""

    user: str
    password: str = field(repr=False)
    inbox_prefix: str | None = None

    @classmethod
    def for_token(cls, token: str) -> Login:
        """The NATS login of a tenant credential: its password is the token itself."""
        key = token_key(token)
        return cls(tenant_user(key), token, tenant_inbox(key))

    @classmethod
    def read(cls, path: str | Path) -> Login:
        """The login in a JSON file ``{"user": ..., "password": ...}``."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["user"]), str(data["password"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise errors.InvalidArgument(f"cannot read the NATS login file {path}: {exc}") from None


def server_urls(url: str) -> list[str]:
    """The servers of ``url`` (one, or several separated by commas), without credentials."""
    parts = [urlsplit(u.strip()) for u in url.split(",") if u.strip()]
    return [p._replace(netloc=p.netloc.rpartition("@")[2]).geturl() for p in parts]


def login_in_url(url: str) -> Login | None:
    """The user and password in ``url`` (its first server's), if it has them."""
    first = urlsplit(url.split(",")[0].strip())
    if not first.username:
        return None
    return Login(unquote(first.username), unquote(first.password or ""))


def _describe(exc: BaseException | None) -> str:
    return "no answer" if exc is None else str(exc) or type(exc).__name__


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.Error) and "authorization violation" in str(exc).lower()


async def _abandon(nc: NATS, connecting: asyncio.Future[None]) -> None:
    """Stop a connect that has not succeeded and release its socket."""
    connecting.cancel()
    await asyncio.wait({connecting})
    try:
        await nc.close()
    except Exception:  # a half-made connection; nothing left to release but the socket
        pass


class _Client(NATS):
    """nats-py's client, but a message it cannot parse is dropped, not fatal.

    A subject, reply subject or header that is not UTF-8 makes nats-py raise while building
    the message, inside its read loop, which then stops: the connection reads nothing more
    until the server's pings declare it stale (minutes). Any tenant may publish such a
    request to the API, so a service that read it would go deaf for everyone. Overridden
    here, not patched upstream: the one method that turns protocol frames into messages."""

    _dropped = 0

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:  # type: ignore[no-untyped-def]
        try:
            await super()._process_msg(sid, subject, reply, data, headers)
        except Exception as exc:
            _Client._dropped += 1
            if _Client._dropped & (_Client._dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.warning(
                    "dropped %d message(s) that could not be read (the last on %.80r: %s)",
                    _Client._dropped, subject, exc,
                )  # fmt: skip


async def connect(
    url: str,
    *,
    name: str,
    login: Login | None = None,
    credentials: str | None = None,
    disconnected_cb: Callable[[], Awaitable[None]] | None = None,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
    timeout: float = 10.0,
) -> NATS:
    """Connect to NATS (``url``: one server, or several separated by commas); once connected
    it reconnects for ever, unless NATS refuses the login (it was removed): then the
    connection is closed.

    ``login`` is the user, password and inbox prefix (without it: the URL's user and password,
    if any); ``credentials`` a NATS ``.creds`` file for clusters that require one. Raises
    Unauthenticated at once if NATS refuses the login, Unavailable if no server accepts the
    connection within ``timeout`` seconds.
    """
    servers = server_urls(url)
    # credentials as options, not in the URLs: the servers a cluster advertises (and a client
    # may reconnect to) carry none, and must get the same ones
    login = login or login_in_url(url)
    auth: dict[str, str] = {}
    if login is not None:
        auth = {"user": login.user, "password": login.password}
        if login.inbox_prefix:
            auth["inbox_prefix"] = login.inbox_prefix
    up = False
    closing: list[asyncio.Future[None]] = []
    last: BaseException | None = None
    refused = asyncio.Event()

    async def on_error(exc: BaseException) -> None:
        nonlocal last
        if up and _refused(exc):  # the login was removed: reconnecting cannot succeed
            log.warning("NATS refused the login of %s now; closing its connection", name)
            closing.append(asyncio.ensure_future(nc.close()))  # not from its reconnect task
        elif up:
            log.warning("NATS connection %s: %s", name, _describe(exc))
        else:
            if last is None and not _refused(exc):  # once: a wait the caller can see
                log.warning("NATS at %s does not answer yet (%s); trying for up to %gs",
                            ", ".join(servers), _describe(exc), timeout)  # fmt: skip
            last = exc
            if _refused(exc):
                refused.set()

    nc = _Client()
    connecting = asyncio.ensure_future(
        nc.connect(
            servers,
            **auth,  # type: ignore[arg-type]
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=min(5.0, timeout),
            allow_reconnect=True,
            user_credentials=credentials,
            error_cb=on_error,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            pending_size=64 << 20,
            ping_interval=PING_INTERVAL_S,  # a stale connection is seen within seconds
            max_outstanding_pings=3,
        )
    )
    watch = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait(
            {connecting, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        await _abandon(nc, connecting)
        raise
    finally:
        watch.cancel()
    if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
        up = True
        return nc
    await _abandon(nc, connecting)
    if last is None and not connecting.cancelled():
        last = connecting.exception()
    where = ", ".join(servers)
    if refused.is_set():
        raise errors.Unauthenticated(
            f"NATS at {where} refused the login {login.user if login else '(none)'}: "
            "an unknown or removed credential (check DSEC_TOKEN, or --nats-login-file)"
        )
    raise errors.Unavailable(
        f"cannot reach NATS at {where} within {timeout:g}s: {_describe(last)}; "
        "is `dsec up` running, or is --nats-url / DSEC_URL right?"
    )


async def connect_service(
    url: str, name: str, login_file: Path | None = None, credentials: Path | None = None
) -> NATS:
    """A service's connection: the login from ``login_file`` (the service password never in
    a URL or an environment), or ``credentials`` (a NATS creds file)."""
    if "@" in url:
        log.warning(
            "the NATS URL carries a credential, which every process this one starts inherits "
            "(a sandbox's init included): give it with --nats-login-file instead"
        )
    login = Login.read(login_file) if login_file else None
    return await connect(url, name=name, login=login, credentials=credentials, timeout=30)


async def wait_accepted(url: str, login: Login, timeout: float) -> None:
    """Return once every server of ``url`` accepts ``login`` (a login just made becomes live
    when the servers reload their configuration); Unauthenticated if one still refuses it
    after ``timeout`` seconds, Unavailable if one cannot be reached."""
    deadline = time.monotonic() + timeout

    async def quiet(exc: BaseException) -> None:
        pass

    for server in server_urls(url):
        while True:
            nc = NATS()
            try:
                await nc.connect(
                    server,
                    user=login.user,
                    password=login.password,
                    name="dsec-login-check",
                    allow_reconnect=False,
                    connect_timeout=2,
                    error_cb=quiet,
                )
                break
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                if time.monotonic() > deadline:
                    kind = errors.Unauthenticated if _refused(exc) else errors.Unavailable
                    raise kind(
                        f"NATS at {server} does not accept the login {login.user} after "
                        f"{timeout:g}s: {_describe(exc)}"
                    ) from None
                await asyncio.sleep(0.02)
            finally:  # a refused connection too: nats-py leaves its socket open
                await nc.close()


async def disconnect(nc: NATS, timeout: float = 5.0) -> None:
    """Drain the connection (pending messages delivered, subscriptions gone); if NATS does
    not answer within ``timeout`` (it is gone), just close it."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except (TimeoutError, nats.errors.Error):
        try:
            await nc.close()
        except (RuntimeError, OSError):  # nats-py flushing into a transport already closed
            pass
