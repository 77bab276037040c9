"""The NATS bus: subjects, request/reply with typed errors, and services.

Subjects (all under ``dsec.``)::

    dsec.api.v1.<op>             apiserver endpoints   (queue group "apiserver")
    dsec.edge.<node>.v1.<op>     one node's edge       (queue group "edge")

A reply is either the expected message, or an :class:`~dsec_kernel.contract.wire.Error` body with
the NATS micro error headers (``Nats-Service-Error-Code``); :func:`request` raises the
matching :class:`~dsec_kernel.contract.errors.DsecError`. Callers authenticate with the
``Dsec-Token`` header.

Logins: the services log in as the service user (:class:`Login`, from a file); each tenant
credential (a token) is a NATS user of its own, named after the token's key, that may publish
only to ``dsec.api.v1.>`` and subscribe only below its inbox prefix ``_I.<id>``
(:meth:`Login.for_token`). A service that answers tenants passes
``accept=replies_to_caller`` to :func:`serve`: a request is answered only on the inbox of
the token it carries, so no tenant can aim a reply at another's inbox or at a service.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.micro import Request, ServiceConfig, add_service
from nats.micro.request import ERROR_CODE_HEADER
from nats.micro.service import EndpointConfig, Service
from pydantic import BaseModel, ValidationError

from dsec_kernel import replies
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import Error, Message

__all__ = [
    "TIMEOUT_HEADER",
    "TOKEN_HEADER",
    "Handler",
    "Login",
    "NoResponders",
    "Request",
    "api_subject",
    "connect",
    "connect_service",
    "disconnect",
    "edge_subject",
    "login_in_url",
    "replies_to_caller",
    "request",
    "request_raw",
    "serve",
    "server_urls",
    "tenant_inbox",
    "tenant_user",
    "time_left",
    "token_key",
    "validation_message",
    "wait_accepted",
]

log = logging.getLogger(__name__)

TOKEN_HEADER = "Dsec-Token"
#: how long the caller waits for the reply, in seconds (every :func:`request` sends it)
TIMEOUT_HEADER = replies.TIMEOUT_HEADER
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
#: how often a connection pings its server (three unanswered: stale, reconnect)
PING_INTERVAL_S = 5.0
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[BaseModel | bytes]]


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


class NoResponders(errors.Unavailable):
    """Nothing subscribes to the subject (a service is down, or starting: for a few
    milliseconds after a service has subscribed, a request may still find none)."""


#: pydantic's bound errors, said shortly
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}  # fmt: skip


def validation_message(exc: ValidationError, names: dict[str, str] | None = None) -> str:
    """A one-line summary of a pydantic error, naming the fields (as ``names`` calls them,
    when the caller knows them by other names: the SDK's ``timeout`` is ``timeout_s``)."""
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str((names or {}).get(str(x), x)) for x in e["loc"]) or "request"
        if (op := _BOUNDS.get(e["type"])) is not None:
            bound = next(iter((e.get("ctx") or {}).values()), "")
            if isinstance(bound, float) and bound.is_integer():
                bound = int(bound)
            parts.append(f"{loc}: must be {op} {bound}")
        else:
            parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def _raise_error_reply(data: bytes) -> None:
    try:
        err = Error.model_validate_json(data)
    except ValidationError:
        raise errors.Internal(f"malformed error reply: {data[:200]!r}") from None
    raise errors.error_class(err.code)(err.message, retryable=err.retryable)


async def request(
    nc: NATS,
    subject: str,
    payload: Message | bytes,
    reply: type[M],
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> M:
    """Send a request and parse the reply as ``reply``, raising typed errors.

    NATS "no responders" becomes Unavailable, no reply in time DeadlineExceeded.
    """
    data = payload if isinstance(payload, bytes) else payload.model_dump_json().encode()
    msg = await request_raw(nc, subject, data, timeout=timeout, headers=headers)
    try:
        return reply.model_validate_json(msg)
    except ValidationError as exc:
        raise errors.Internal(f"malformed reply on {subject}: {validation_message(exc)}") from None


async def request_raw(
    nc: NATS,
    subject: str,
    data: bytes,
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> bytes:
    """Like :func:`request`, returning the reply body unparsed (errors still raised)."""
    headers = {**(headers or {}), TIMEOUT_HEADER: f"{timeout:.3f}"}
    try:
        msg = await replies.request(nc, subject, data, timeout=timeout, headers=headers)
    except nats.errors.NoRespondersError:
        hint = (
            "; is `dsec up` (or `dsec apiserver`) running against this NATS?"
            if subject.startswith("dsec.api.")
            else ""
        )
        raise NoResponders(f"nothing is serving {subject}{hint}") from None
    except nats.errors.TimeoutError:
        raise errors.DeadlineExceeded(f"no reply on {subject} within {timeout:.1f}s") from None
    except nats.errors.ConnectionClosedError:
        raise errors.Unavailable("the NATS connection is closed") from None
    if msg.headers and ERROR_CODE_HEADER in msg.headers:
        _raise_error_reply(msg.data)
    return msg.data


async def _respond_error(req: Request, err: errors.DsecError) -> None:
    body = Error.of(err).model_dump_json().encode()
    await req.respond_error(err.code, err.message[:200].replace("\n", " "), data=body)


# What a JetStream call raises while the stream it needs has no leader (lost with a server,
# being elected) or the cluster no quorum.
STATE_DOWN = (
    errors.StateUnavailable,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
ELECTION_WAIT_S = 30.0  # how long a request that said no deadline waits for the state


async def _through_elections(handler: Handler, req: Request) -> BaseModel | bytes:
    """``handler(req)``, run again while the cluster's state does not answer, until its
    caller stops waiting (less a second to answer; :data:`ELECTION_WAIT_S` if it did not
    say): a NATS server lost takes its streams' leaders with it for the 4-9 s nats-server's
    raft needs to elect others. Every request is safe to repeat (the SDK resends them too:
    creates and commands by request id, the rest reads or idempotent). Then Unavailable."""
    left = time_left()
    until = time.monotonic() + (ELECTION_WAIT_S if left is None else left) - 1.0
    pause = 0.1
    while True:
        try:
            return await handler(req)
        except STATE_DOWN as exc:
            if time.monotonic() + pause > until:
                log.warning("%s: the cluster's state did not answer in time: %r", req.subject, exc)
                raise errors.Unavailable(
                    "the cluster's state store (JetStream) did not answer in time: a NATS "
                    "server lost? It elects new leaders within ~10 s; retry"
                ) from None
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)


def time_left() -> float | None:
    """Seconds until the caller of the request being handled stops waiting for its reply
    (what its ``Dsec-Timeout`` said, from when it came; at least 0), or None if it did not
    say. Work that would only be done after that may be refused instead."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def replies_to_caller(req: Request) -> bool:
    """Whether ``req``'s reply subject lies in the inbox of the credential it carries (what a
    tenant's own login subscribes to). A tenant may put any reply subject on a request: a
    service that answered this one anyway would publish, with its own rights, into another
    tenant's inbox or onto a service subject."""
    token = (req.headers or {}).get(TOKEN_HEADER)
    reply = req._msg.reply  # nats.micro's Request does not expose it
    return bool(token) and reply.startswith(tenant_inbox(token_key(token)) + ".")


class _Endpoints:
    """Runs each request's handler in its own task (nats-py delivers one message at a time
    per subscription) and answers it, turning exceptions into error replies. A request that
    ``accept`` refuses is dropped unanswered before any work (logged at debug level, at most
    a line a second).

    At most ``limit`` requests run at once, and at most ``per_caller`` of one credential's
    (the token a request carries; none: only the total counts), holding at most
    ``caller_bytes`` of requests (bodies and headers) together (a tenant's queued calls of
    16 MiB each would otherwise fill the services' memory). One past any is answered at once
    with a retryable error, never made to wait: the subscription's callback must not
    block, or every caller's requests would queue behind one caller's thousands of long
    waits (a tenant's 20,500 creates with ``wait_s=600`` once held every other tenant's calls
    for ten minutes)."""

    def __init__(
        self,
        limit: int,
        per_caller: int | None,
        caller_bytes: int | None,
        accept: Callable[[Request], bool] | None,
    ) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.limit = limit
        self.per_caller = per_caller
        self.caller_bytes = caller_bytes
        self.running: Counter[str] = Counter()
        self.holding: Counter[str] = Counter()  # bytes of request bodies in flight
        self.accept = accept
        self.dropped = 0
        self._logged_at = 0.0

    def _drop(self, req: Request) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            self._logged_at = now
            log.debug(
                "dropped %d request(s) so far with a reply subject outside the caller's inbox "
                "(the last on %s, replying to %.80s)",
                self.dropped, req.subject, req._msg.reply,
            )  # fmt: skip

    def _refusal(self, caller: str, size: int) -> errors.DsecError | None:
        if len(self.tasks) >= self.limit:
            return errors.Unavailable(
                f"the service is running {self.limit} requests; retry in a moment"
            )
        if self.per_caller is not None and self.running[caller] >= self.per_caller:
            return errors.QueueFull(
                f"this credential has {self.per_caller} requests in flight, the most it may; "
                "wait for some to finish (batch calls take many sandboxes in one)"
            )
        if self.caller_bytes is not None and self.holding[caller] + size > self.caller_bytes:
            return errors.QueueFull(
                f"this credential's requests in flight hold {self.holding[caller]} bytes; one "
                f"of {size} more would pass the {self.caller_bytes} it may: wait for some"
            )
        return None

    def wrap(self, handler: Handler) -> Callable[[Request], Awaitable[None]]:
        async def answer(req: Request) -> None:
            try:
                waits = float((req.headers or {}).get(TIMEOUT_HEADER, "nan"))
            except ValueError:
                waits = float("nan")
            if 0 <= waits <= 86_400:  # (a NaN is neither)
                _deadline.set(time.monotonic() + waits)
            working = replies.KeepAlive(req._msg._client, req._msg.reply)
            try:
                result = await _through_elections(handler, req)
            except errors.DsecError as exc:
                error: errors.DsecError | None = exc
            except ValidationError as exc:
                error = errors.InvalidArgument(validation_message(exc))
            except Exception:  # its text may name host paths or processes: logged only
                ref = secrets.token_hex(4)
                log.exception("handler for %s failed (ref %s)", req.subject, ref)
                error = errors.Internal(f"an unexpected failure (ref {ref} in the log)")
            else:
                error = None
            finally:
                working.cancel()
            if error is not None:
                await _respond_error(req, error)
                return
            data = result if isinstance(result, bytes) else result.model_dump_json().encode()
            await req.respond(data)

        async def run(
            req: Request, caller: str, size: int, refusal: errors.DsecError | None
        ) -> None:
            try:
                await (answer(req) if refusal is None else _respond_error(req, refusal))
            except Exception:
                log.exception("could not answer a request on %s", req.subject)
            finally:
                self.running[caller] -= 1
                self.holding[caller] -= 0 if refusal else size
                if not self.running[caller]:
                    del self.running[caller], self.holding[caller]

        async def spawn(req: Request) -> None:
            if self.accept is not None and not self.accept(req):
                self._drop(req)
                return
            headers = req.headers or {}
            token = headers.get(TOKEN_HEADER)
            caller = token_key(token) if token else ""
            size = len(req.data) + sum(len(k) + len(v) for k, v in headers.items())
            refusal = self._refusal(caller, size)
            self.running[caller] += 1  # (a refused one too, until its answer is sent)
            self.holding[caller] += 0 if refusal else size
            task = asyncio.create_task(run(req, caller, size, refusal))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        return spawn


async def serve(
    nc: NATS,
    *,
    name: str,
    version: str,
    description: str,
    queue_group: str,
    endpoints: dict[str, Handler],
    concurrency: int = 20_000,
    per_caller: int | None = None,
    caller_bytes: int | None = None,
    accept: Callable[[Request], bool] | None = None,
) -> tuple[Service, Callable[[], Awaitable[None]]]:
    """Start a NATS micro service with one endpoint per ``{subject: handler}``.

    Handlers return a reply message (or raw bytes) or raise a DsecError. A request for which
    ``accept`` (e.g. :func:`replies_to_caller`) is false gets no reply and runs nothing. At
    most ``concurrency`` requests run at once, ``per_caller`` of one credential's, holding at
    most ``caller_bytes`` of request bodies; more are refused at once (retryable).
    Returns the service and a ``drain`` coroutine function that stops taking requests and
    waits for those in flight.
    """
    svc = await add_service(
        nc,
        ServiceConfig(name=name, version=version, description=description),
    )
    runner = _Endpoints(concurrency, per_caller, caller_bytes, accept)
    for subject, handler in endpoints.items():
        await svc.add_endpoint(
            EndpointConfig(
                name=subject.replace(".", "-").replace("*", "any").replace(">", "all"),
                subject=subject,
                queue_group=queue_group,
                handler=runner.wrap(handler),
            )
        )
    await nc.flush()  # subscribed at the server on return: a request sent now finds us

    async def drain() -> None:
        try:  # unsubscribing waits on the server: bounded, for when NATS is gone
            await asyncio.wait_for(svc.stop(), 5)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("stopping the service %s: %r; going on", name, exc)
        if runner.tasks:
            await asyncio.wait(set(runner.tasks), timeout=30)

    return svc, drain


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
