"""Serving endpoints: a NATS micro service whose requests each run in a task of their own,
within limits, and whose ``$SRV.STATS`` tell the truth.

nats-py delivers one message at a time per subscription, so an endpoint's handler only
starts the task that answers; nats.micro, which times and counts what its handler raises,
would see a few microseconds and no errors. So the bus keeps each endpoint's stats itself
(:class:`_Endpoint`): a request counts when its reply is sent, with the time from its
receipt to then, and every error reply counts as an error (refusals for the limits too, and
a request dropped unanswered).

A service that answers tenants passes ``accept=replies_to_caller``: a request is answered
only on the inbox of the token it carries, so no tenant can aim a reply at another's inbox
or at a service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro import Request, ServiceConfig, add_service
from nats.micro.service import Endpoint as MicroEndpoint
from nats.micro.service import EndpointConfig, Service

from dsec_kernel.bus.endpoints import Authenticate, Endpoint, Handler, Route, answer, route
from dsec_kernel.bus.error_replies import one_line, respond_error
from dsec_kernel.bus.subjects import TOKEN_HEADER, tenant_inbox, token_key
from dsec_kernel.contract import errors

__all__ = ["InFlight", "replies_to_caller", "serve"]

log = logging.getLogger(__name__)

_DROPPED = "dropped:not accepted (no reply sent)"


def replies_to_caller(req: Request) -> bool:
    """Whether ``req``'s reply subject lies in the inbox of the credential it carries (what a
    tenant's own login subscribes to). A tenant may put any reply subject on a request: a
    service that answered this one anyway would publish, with its own rights, into another
    tenant's inbox or onto a service subject."""
    token = (req.headers or {}).get(TOKEN_HEADER)
    reply = req._msg.reply  # nats.micro's Request does not expose it
    return bool(token) and reply.startswith(tenant_inbox(token_key(token)) + ".")


class _Endpoint(MicroEndpoint):
    """nats.micro's endpoint, its requests handed to the service's :class:`InFlight` and its
    stats (read by nats.micro's ``$SRV.STATS``) kept by :meth:`record`."""

    def __init__(self, service: Service, config: EndpointConfig, runs: InFlight) -> None:
        super().__init__(service, config)
        self.route: Route = config.handler  # type: ignore[assignment]
        self._runs = runs

    async def _handle_request(self, msg: Msg) -> None:
        self._runs.start(self, Request(msg))

    def record(self, started_ns: int, error: str | None) -> None:
        """A request received at ``started_ns`` (``perf_counter_ns``) is answered now, with
        ``error`` (``code:description``) or not."""
        self._num_requests += 1
        self._processing_time += time.perf_counter_ns() - started_ns
        self._average_processing_time = self._processing_time // self._num_requests
        if error is not None:
            self._num_errors += 1
            self._last_error = error  # type: ignore[assignment]


class InFlight:
    """The requests a service is answering, each in its own task. A request that ``accept``
    refuses is dropped unanswered before any work (logged at debug level, at most a line a
    second).

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

    def refusal(self, caller: str, size: int) -> errors.DsecError | None:
        """The error a request of ``size`` bytes from ``caller`` is refused with, if any."""
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

    def start(self, endpoint: _Endpoint, req: Request) -> None:
        """Start answering ``req`` (or drop it), without waiting."""
        started = time.perf_counter_ns()
        if self.accept is not None and not self.accept(req):
            self._drop(req)
            endpoint.record(started, _DROPPED)
            return
        headers = req.headers or {}
        token = headers.get(TOKEN_HEADER)
        caller = token_key(token) if token else ""
        size = len(req.data) + sum(len(k) + len(v) for k, v in headers.items())
        refusal = self.refusal(caller, size)
        self.running[caller] += 1  # (a refused one too, until its answer is sent)
        self.holding[caller] += 0 if refusal else size
        task = asyncio.create_task(self._run(endpoint, req, started, caller, size, refusal))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(
        self,
        endpoint: _Endpoint,
        req: Request,
        started: int,
        caller: str,
        size: int,
        refusal: errors.DsecError | None,
    ) -> None:
        failed: str | None = None
        try:
            reply = refusal or await answer(endpoint.route, req, caller)
            if isinstance(reply, errors.DsecError):
                failed = f"{reply.code}:{one_line(reply)}"
                await respond_error(req, reply)
            else:
                await req.respond(
                    reply if isinstance(reply, bytes) else reply.model_dump_json().encode()
                )
        except Exception as exc:
            failed = f"unanswered:{exc!r}"
            log.exception("could not answer a request on %s", req.subject)
        finally:
            self.running[caller] -= 1
            self.holding[caller] -= 0 if refusal else size
            if not self.running[caller]:
                del self.running[caller], self.holding[caller]
        endpoint.record(started, failed)


async def serve(
    nc: NATS,
    *,
    name: str,
    version: str,
    description: str,
    queue_group: str,
    endpoints: Mapping[str, Endpoint[Any] | Handler],
    authenticate: Authenticate | None = None,
    concurrency: int = 20_000,
    per_caller: int | None = None,
    caller_bytes: int | None = None,
    accept: Callable[[Request], bool] | None = None,
) -> tuple[Service, Callable[[], Awaitable[None]]]:
    """Start a NATS micro service with one endpoint per ``{subject: endpoint}``: an
    :class:`~dsec_kernel.bus.endpoints.Endpoint` declaration, or a plain handler.

    ``authenticate`` resolves the tenant of the endpoints declared with ``tenant=True``
    (ValueError if one is and it is not given). A request for which ``accept`` (e.g.
    :func:`replies_to_caller`) is false gets no reply and runs nothing. At most
    ``concurrency`` requests run at once, ``per_caller`` of one credential's, holding at most
    ``caller_bytes`` of request bodies; more are refused at once (retryable).
    Returns the service and a ``drain`` coroutine function that stops taking requests and
    waits for those in flight.
    """
    routes = {subject: route(subject, e, authenticate) for subject, e in endpoints.items()}
    svc = await add_service(
        nc,
        ServiceConfig(name=name, version=version, description=description),
    )
    runs = InFlight(concurrency, per_caller, caller_bytes, accept)
    for subject, work in routes.items():
        config = EndpointConfig(
            name=subject.replace(".", "-").replace("*", "any").replace(">", "all"),
            subject=subject,
            queue_group=queue_group,
            handler=work,  # type: ignore[arg-type]  # (called by InFlight, not nats.micro)
        )
        endpoint = _Endpoint(svc, config, runs)
        await endpoint._start()  # what Service.add_endpoint does, with the bus's endpoint
        svc._endpoints.append(endpoint)
    await nc.flush()  # subscribed at the server on return: a request sent now finds us

    async def drain() -> None:
        try:  # unsubscribing waits on the server: bounded, for when NATS is gone
            await asyncio.wait_for(svc.stop(), 5)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("stopping the service %s: %r; going on", name, exc)
        if runs.tasks:
            await asyncio.wait(set(runs.tasks), timeout=30)

    return svc, drain
