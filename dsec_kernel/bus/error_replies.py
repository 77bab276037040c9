"""Errors on the wire: an error reply is an :class:`~dsec_kernel.contract.wire.Error` body
with the NATS micro error headers (``Nats-Service-Error-Code``); a service sends it for a
:class:`~dsec_kernel.contract.errors.DsecError` (:func:`respond_error`), a caller raises the
matching one (:func:`raise_error_reply`).
"""

from __future__ import annotations

from nats.micro import Request
from pydantic import ValidationError

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import Error

__all__ = ["one_line", "raise_error_reply", "respond_error", "validation_message"]

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


def one_line(err: errors.DsecError) -> str:
    """What the error header says of ``err``: its message on one line, cut to 200 characters."""
    return err.message[:200].replace("\n", " ")


async def respond_error(req: Request, err: errors.DsecError) -> None:
    body = Error.of(err).model_dump_json().encode()
    await req.respond_error(err.code, one_line(err), data=body)


def raise_error_reply(data: bytes) -> None:
    """Raise the error an error reply's body ``data`` names (Internal if it is not one)."""
    try:
        err = Error.model_validate_json(data)
    except ValidationError:
        raise errors.Internal(f"malformed error reply: {data[:200]!r}") from None
    raise errors.error_class(err.code)(err.message, retryable=err.retryable)
