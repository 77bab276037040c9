"""The base of every wire message and the one error shape.

Contract (NATS ADR-2 style): every message carries ``type = "io.dsec.<area>.v1.<name>"``;
inside v1 changes only *add optional fields*, so readers ignore fields they do not know.
Bytes travel as base64 strings in JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from dsec_kernel.contract import errors

__all__ = [
    "NAME_PATTERN",
    "SANDBOX_ID_PATTERN",
    "SNAPSHOT_ID_PATTERN",
    "Error",
    "Message",
    "Name",
    "SandboxId",
    "SnapshotId",
    "TypedError",
]

#: Sandbox ids are ``sb-`` and 16 lowercase hex digits; also safe as a KV key and a path element.
SANDBOX_ID_PATTERN = r"^sb-[0-9a-f]{16}$"
#: Names of tenants, nodes, backends and labels: safe in NATS subjects and KV keys.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
# a snapshot's id: minted by its backend, opaque to the kernel (no "/", so safe in a path)
SNAPSHOT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

SandboxId = Annotated[str, Field(pattern=SANDBOX_ID_PATTERN)]
SnapshotId = Annotated[str, Field(pattern=SNAPSHOT_ID_PATTERN)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class Message(BaseModel):
    """A versioned wire message. Subclasses pin ``type`` to a Literal."""

    model_config = ConfigDict(
        extra="ignore",
        ser_json_bytes="base64",
        val_json_bytes="base64",
        populate_by_name=True,
    )

    type: str


class Error(Message):
    """The single error shape used on every subject.

    ``code`` is one of :mod:`~dsec_kernel.contract.errors`' codes; ``retryable`` says whether
    the same request may succeed if sent again unchanged.
    """

    type: Literal["io.dsec.error.v1.error"] = "io.dsec.error.v1.error"
    code: str = Field(description="machine-readable error code, e.g. not_found")
    message: str = Field(description="what went wrong and what to do next")
    retryable: bool = False

    @classmethod
    def of(cls, exc: errors.DsecError) -> Error:
        """The wire shape of ``exc``."""
        return cls(code=exc.code, message=exc.message, retryable=exc.retryable)

    def exception(self) -> errors.DsecError:
        """The exception this error stands for (Internal for a code unknown here)."""
        return errors.error_class(self.code)(self.message, retryable=self.retryable)


def _typed(value: Any) -> errors.DsecError:
    if isinstance(value, errors.DsecError):
        return value
    return Error.model_validate(value).exception()


#: A field holding an error: the :class:`Error` shape on the wire, the matching
#: :class:`~dsec_kernel.contract.errors.DsecError` instance in Python (given either).
TypedError = Annotated[
    errors.DsecError,
    PlainValidator(_typed, json_schema_input_type=Error),
    PlainSerializer(Error.of, return_type=Error),
]
