"""Map dpfed's errors to gRPC status codes, in one place.

Status details never contain data values: error messages in dpfed name parameters, ids and
counts only.
"""

from __future__ import annotations

import grpc

from dpfed.common.errors import (
    AuthenticationError,
    BudgetExceededError,
    ConfigError,
    DpfedError,
    IdempotencyConflictError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    QuorumError,
    ValidationError,
)

_STATUS: list[tuple[type[Exception], grpc.StatusCode]] = [
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (BudgetExceededError, grpc.StatusCode.FAILED_PRECONDITION),
    (QuorumError, grpc.StatusCode.FAILED_PRECONDITION),
    (IdempotencyConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """Return the status code reporting ``exc`` (INTERNAL for anything unexpected)."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def tls_hint(details: str) -> str:
    """Return a hint for a failed connection whose gRPC details point at the TLS handshake."""
    lowered = details.lower()
    if any(w in lowered for w in ("handshake", "certificate", "ssl")):
        return (" -- TLS handshake failed: check that the coordinator's certificate is from the "
                "federation CA you were given, and that the address (or the TLS server name) "
                "is a name in it")
    return ""


def details_for(exc: BaseException) -> str:
    """Return the status message: dpfed's own, or a generic one for unexpected errors."""
    if isinstance(exc, DpfedError):
        return str(exc)
    return "internal error in the coordinator (see its log)"
