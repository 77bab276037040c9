"""Endpoints as declarations, and answering a request once for all of them.

An endpoint is declared with :class:`Endpoint`: its handler, the request model it takes and
whether it needs the caller's tenant::

    async def status(r: StatusRequest, call: bus.Call) -> SandboxInfo:
        return await lookup(call.tenant, r.id)

    await bus.serve(nc, ..., authenticate=tenant_of, endpoints={
        bus.api_subject("status"): bus.Endpoint(status, request=StatusRequest, tenant=True),
    })

The bus then does for every request what each handler did before: it resolves the caller's
tenant (:data:`Authenticate`; none or unknown: Unauthenticated, before the body is read),
parses the body into the request model, runs the handler again while the cluster's state is
between leaders, and turns what the handler raised into the error reply: a DsecError as it
is, a pydantic ValidationError as InvalidArgument naming the fields, anything else as Internal
with a reference to the log (its text may name host paths or processes). A plain
:data:`Handler` (given the NATS request, doing its own parsing and auth) is served too.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from nats.micro import Request
from pydantic import BaseModel, ValidationError

from dsec_kernel import deadline
from dsec_kernel.bus.elections import through_elections
from dsec_kernel.bus.error_replies import validation_message
from dsec_kernel.bus.replies import TIMEOUT_HEADER, KeepAlive
from dsec_kernel.contract import errors

__all__ = ["Authenticate", "Call", "Endpoint", "Handler", "Reply", "Route", "answer", "route"]

log = logging.getLogger(__name__)

M = TypeVar("M")

#: what a handler answers with: a message, or a body already encoded
Reply = BaseModel | bytes
#: a plain handler: given the NATS request, it parses the body and authenticates itself
Handler = Callable[[Request], Awaitable[Reply]]
#: the tenant of the credential stored under a key (:func:`~dsec_kernel.bus.token_key` of
#: the token a request carries), or None if there is none
Authenticate = Callable[[str], Awaitable[str | None]]
#: an endpoint made ready to answer: called with the request and its caller's credential key
Route = Callable[[Request, str], Awaitable[Reply]]

_UNAUTHENTICATED = (
    "missing or unknown credential: pass token= / set DSEC_TOKEN, or use the connection file "
    "that `dsec up` writes"
)


class Call:
    """What a declared endpoint's handler knows of its request besides the parsed body."""

    __slots__ = ("_req", "tenant")

    def __init__(self, req: Request, tenant: str) -> None:
        self._req = req
        #: the caller's tenant ("" on an endpoint declared without ``tenant=True``)
        self.tenant = tenant

    @property
    def subject(self) -> str:
        return self._req.subject

    @property
    def headers(self) -> dict[str, str]:
        """The request's headers, as the caller sent them (the ``Dsec-Token`` among them)."""
        return self._req.headers or {}

    @property
    def data(self) -> bytes:
        """The body as it came (to forward it unchanged, without encoding it again)."""
        return self._req.data

    def time_left(self) -> float | None:
        """Seconds until the caller stops waiting (:func:`dsec_kernel.deadline.time_left`)."""
        return deadline.time_left()


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[M]):
    """An endpoint's declaration: ``handler(r, call)`` answers with a message or bytes, or
    raises a DsecError; ``r`` is the body parsed as ``request`` (without one: the body's
    bytes); with ``tenant`` the request is answered only for a caller whose credential
    :data:`Authenticate` knows (``call.tenant``)."""

    handler: Callable[[M, Call], Awaitable[Reply]]
    request: type[M] | None = None
    tenant: bool = False


class _Declared:
    """The route of an :class:`Endpoint`: authenticate, parse, handle."""

    __slots__ = ("authenticate", "handler", "parse")

    def __init__(self, endpoint: Endpoint[M], authenticate: Authenticate | None) -> None:
        self.handler = endpoint.handler
        model = endpoint.request
        self.parse = None if model is None else model.model_validate_json  # type: ignore[attr-defined]
        self.authenticate = authenticate if endpoint.tenant else None

    async def __call__(self, req: Request, caller: str) -> Reply:
        tenant = ""
        if self.authenticate is not None:
            tenant = (await self.authenticate(caller) if caller else None) or ""
            if not tenant:
                raise errors.Unauthenticated(_UNAUTHENTICATED)
        body = req.data
        return await self.handler(
            body if self.parse is None else self.parse(body), Call(req, tenant)
        )


def route(
    subject: str, endpoint: Endpoint[M] | Handler, authenticate: Authenticate | None
) -> Route:
    """``endpoint`` (serving ``subject``) made ready to answer; ValueError if it needs a
    tenant and no ``authenticate`` is given."""
    if isinstance(endpoint, Endpoint):
        if endpoint.tenant and authenticate is None:
            raise ValueError(f"{subject} needs a tenant: serve it with authenticate=")
        return _Declared(endpoint, authenticate)

    async def plain(req: Request, caller: str) -> Reply:
        return await endpoint(req)

    return plain


async def answer(work: Route, req: Request, caller: str) -> Reply | errors.DsecError:
    """What to answer ``req`` with: ``work``'s reply, or the error to reply with.

    The request's deadline (:mod:`dsec_kernel.deadline`) starts from its ``Dsec-Timeout``;
    while it is worked on, its caller is told so every second (:class:`KeepAlive`).
    """
    try:
        waits = float((req.headers or {}).get(TIMEOUT_HEADER, "nan"))
    except ValueError:
        waits = float("nan")
    if 0 <= waits <= 86_400:  # (a NaN is neither)
        deadline.start(waits)
    working = KeepAlive(req._msg._client, req._msg.reply)
    try:
        return await through_elections(work, req, caller)
    except errors.DsecError as exc:
        return exc
    except ValidationError as exc:
        return errors.InvalidArgument(validation_message(exc))
    except Exception:  # its text may name host paths or processes: logged only
        ref = secrets.token_hex(4)
        log.exception("handler for %s failed (ref %s)", req.subject, ref)
        return errors.Internal(f"an unexpected failure (ref {ref} in the log)")
    finally:
        working.cancel()
