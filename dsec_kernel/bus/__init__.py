"""The NATS bus: subjects, logins, request/reply with typed errors, and services.

A reply is either the expected message, or an :class:`~dsec_kernel.contract.wire.Error` body
with the NATS micro error headers; :func:`request` raises the matching
:class:`~dsec_kernel.contract.errors.DsecError`. Callers authenticate with the ``Dsec-Token``
header and say how long they wait with ``Dsec-Timeout``.

The parts, each importing only those above it:

=================== ====================================================================
``subjects``        subject names, the credential header, a token's key, user and inbox
``connecting``      connecting and logging in (:class:`Login`), disconnecting
``replies``         replies that survive a lost server: keep-alives, requests sent again
``error_replies``   the error reply's shape, sent and raised; :func:`validation_message`
``calling``         :func:`request`, :func:`request_raw`
``elections``       requests worked again while the cluster's state elects leaders
``endpoints``       :class:`Endpoint` declarations, :class:`Call`, answering a request
``serving``         :func:`serve`: limits per caller, true ``$SRV.STATS``
=================== ====================================================================

This module is the bus's interface (``from dsec_kernel import bus``, then ``bus.<name>``);
the parts import each other directly, never through it.
"""

from nats.micro import Request

from dsec_kernel.bus.calling import NoResponders, request, request_raw
from dsec_kernel.bus.connecting import (
    Login,
    connect,
    connect_service,
    disconnect,
    login_in_url,
    server_urls,
    wait_accepted,
)
from dsec_kernel.bus.elections import STATE_DOWN
from dsec_kernel.bus.endpoints import Authenticate, Call, Endpoint, Handler
from dsec_kernel.bus.error_replies import validation_message
from dsec_kernel.bus.replies import TIMEOUT_HEADER
from dsec_kernel.bus.serving import replies_to_caller, serve
from dsec_kernel.bus.subjects import (
    TOKEN_HEADER,
    api_subject,
    edge_subject,
    tenant_inbox,
    tenant_user,
    token_key,
)
from dsec_kernel.deadline import time_left

__all__ = [
    "STATE_DOWN",
    "TIMEOUT_HEADER",
    "TOKEN_HEADER",
    "Authenticate",
    "Call",
    "Endpoint",
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
