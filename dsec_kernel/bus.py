"""The NATS bus: subjects, request/reply with typed errors, and services.

Subjects (all under ``dsec.``)::

    dsec.api.v1.<op>             apiserver endpoints   (queue group "apiserver")
    dsec.edge.<node>.v1.<op>     one node's edge       (queue group "edge")

A reply is either the expected message, or an :class:`~dsec_kernel.wire.Error` body with
the NATS micro error headers (``Nats-Service-Error-Code``); :func:`request` raises the
matching :class:`~dsec_kernel.errors.DsecError`. Callers authenticate with the
``Dsec-Token`` header.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.micro import Request, ServiceConfig, add_service
from nats.micro.request import ERROR_CODE_HEADER
from nats.micro.service import EndpointConfig, Service
from pydantic import BaseModel, ValidationError

from dsec_kernel import errors
from dsec_kernel.wire import Error, Message

__all__ = [
    "TOKEN_HEADER",
    "Handler",
    "Request",
    "api_subject",
    "connect",
    "disconnect",
    "edge_subject",
    "request",
    "request_raw",
    "serve",
    "validation_message",
]

log = logging.getLogger(__name__)

TOKEN_HEADER = "Dsec-Token"
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[BaseModel | bytes]]


def api_subject(op: str) -> str:
    return f"dsec.api.v1.{op}"


def edge_subject(node: str, op: str) -> str:
    return f"dsec.edge.{node}.v1.{op}"


async def connect(
    url: str,
    *,
    name: str,
    credentials: str | None = None,
    disconnected_cb: Callable[[], Awaitable[None]] | None = None,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect to NATS (``url``: one server, or several separated by commas), reconnecting
    for ever; Unavailable if the first connect fails.

    ``credentials`` is a NATS ``.creds`` file for clusters that require one.
    """
    servers = [u.strip() for u in url.split(",") if u.strip()]  # a cluster: any of them
    # credentials as options, not in the URLs: the servers a cluster advertises (and a client
    # may reconnect to) carry none, and must get the same ones
    parts = [urlsplit(u) for u in servers]
    auth = {"user": parts[0].username, "password": parts[0].password} if parts[0].username else {}
    servers = [p._replace(netloc=p.netloc.rpartition("@")[2]).geturl() for p in parts]
    try:
        return await nats.connect(
            servers,
            **auth,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            allow_reconnect=True,
            user_credentials=credentials,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            pending_size=64 << 20,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        where = ", ".join(servers)
        raise errors.Unavailable(
            f"cannot reach NATS at {where}: {exc or type(exc).__name__}; "
            "is `dsec up` running, or is --nats-url / DSEC_URL right?"
        ) from None


def validation_message(exc: ValidationError) -> str:
    """A one-line summary of a pydantic error, naming the fields."""
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e["loc"]) or "request"
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
    try:
        msg = await nc.request(subject, data, timeout=timeout, headers=headers)
    except nats.errors.NoRespondersError:
        hint = (
            "; is `dsec up` (or `dsec apiserver`) running against this NATS?"
            if subject.startswith("dsec.api.")
            else ""
        )
        raise errors.Unavailable(f"nothing is serving {subject}{hint}") from None
    except nats.errors.TimeoutError:
        raise errors.DeadlineExceeded(f"no reply on {subject} within {timeout:.1f}s") from None
    except nats.errors.ConnectionClosedError:
        raise errors.Unavailable("the NATS connection is closed") from None
    if msg.headers and ERROR_CODE_HEADER in msg.headers:
        _raise_error_reply(msg.data)
    return msg.data


async def _respond_error(req: Request, err: errors.DsecError) -> None:
    body = err.to_wire().model_dump_json().encode()
    await req.respond_error(err.code, err.message[:200].replace("\n", " "), data=body)


class _Endpoints:
    """Runs each request's handler in its own task (nats-py delivers one message at a time
    per subscription) and answers it, turning exceptions into error replies."""

    def __init__(self, limit: int) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(limit)

    def wrap(self, handler: Handler) -> Callable[[Request], Awaitable[None]]:
        async def run(req: Request) -> None:
            try:
                try:
                    result = await handler(req)
                except errors.DsecError as exc:
                    await _respond_error(req, exc)
                    return
                except ValidationError as exc:
                    await _respond_error(req, errors.InvalidArgument(validation_message(exc)))
                    return
                except Exception as exc:
                    log.exception("handler for %s failed", req.subject)
                    await _respond_error(req, errors.Internal(f"{type(exc).__name__}: {exc}"))
                    return
                data = result if isinstance(result, bytes) else result.model_dump_json().encode()
                await req.respond(data)
            except Exception:
                log.exception("could not answer a request on %s", req.subject)
            finally:
                self.slots.release()

        async def spawn(req: Request) -> None:
            await self.slots.acquire()
            task = asyncio.create_task(run(req))
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
) -> tuple[Service, Callable[[], Awaitable[None]]]:
    """Start a NATS micro service with one endpoint per ``{subject: handler}``.

    Handlers return a reply message (or raw bytes) or raise a DsecError. Returns the service
    and a ``drain`` coroutine function that stops taking requests and waits for those in flight.
    """
    svc = await add_service(
        nc,
        ServiceConfig(name=name, version=version, description=description),
    )
    runner = _Endpoints(concurrency)
    for subject, handler in endpoints.items():
        await svc.add_endpoint(
            EndpointConfig(
                name=subject.replace(".", "-").replace("*", "any").replace(">", "all"),
                subject=subject,
                queue_group=queue_group,
                handler=runner.wrap(handler),
            )
        )

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
