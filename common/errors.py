"""The project's error hierarchy.

Every error a user can cause has a class here, and its message names the parameter, the
value received and what would be valid, e.g. ``epsilon must be finite and > 0, got -1.0``.
Servicers map these classes to gRPC status codes in one place
(``dpfed.common.transport.grpc_errors``), and
the binaries map them to exit codes (``dpfed.common.exit_codes``).
"""

from __future__ import annotations


class DpfedError(Exception):
    """Base class of every error raised on purpose by dpfed."""


class ConfigError(DpfedError):
    """A configuration file, flag or certificate path is missing or invalid."""


class CertificateError(ConfigError):
    """A certificate or key is missing, unreadable, malformed or does not chain to the CA.

    A ``ConfigError`` (it is found at start-up, from a path in the configuration), kept
    apart so the binaries can exit with ``exit_codes.CERTIFICATE_ERROR``.
    """


class ValidationError(DpfedError, ValueError):
    """An argument, schema, request or data value is invalid."""


class SchemaError(ValidationError):
    """A schema file is malformed, or data does not match the schema."""


class DataError(ValidationError):
    """A data file or table cannot be read as the schema declares."""


class BudgetExceededError(DpfedError):
    """A release would exceed a site's privacy budget; nothing was drawn or released."""


class ProtocolError(DpfedError):
    """A peer sent a message that breaks the dpfed wire protocol."""


class ImpossibleSumError(ProtocolError):
    """A decoded secure sum no honest run can produce: a participant corrupted it.

    Its message starts with :data:`REASON`, the name a job's status gives the failure.
    """

    REASON = "impossible_secure_sum"


class IdempotencyConflictError(DpfedError):
    """A task id was reused with a different payload."""


class AuthenticationError(DpfedError):
    """The peer's certificate does not identify an allowed principal."""


class PermissionDeniedError(DpfedError):
    """The authenticated principal may not call this method."""


class NotFoundError(DpfedError):
    """A job, site or result that was asked for does not exist."""


class QuorumError(DpfedError):
    """Fewer sites answered a job than its ``min_sites`` requires."""


class CoordinatorUnavailableError(DpfedError):
    """The coordinator could not be reached (down, wrong address, or TLS handshake failure)."""


class SiteRejectedError(DpfedError):
    """The coordinator refuses this site (not admitted, revoked, another schema or protocol)."""


class JobFailedError(DpfedError):
    """A job ended in the failed state; the message carries the coordinator's reason."""


class JobBudgetExceededError(JobFailedError, BudgetExceededError):
    """A job failed because the sites refused it for lack of privacy budget.

    Both a :class:`JobFailedError` (the job ended failed) and a :class:`BudgetExceededError`
    (the binaries exit with ``exit_codes.BUDGET_EXCEEDED``, not ``JOB_FAILED``).
    """


class VerificationError(DpfedError):
    """A signed file (a ledger export) does not verify: altered, truncated or wrongly signed."""


class SitesNotConnectedError(DpfedError):
    """The coordinator answered, but fewer sites than asked for connected in time."""


class ProcessExitedError(DpfedError):
    """A dpfed process this one started (``dpfed simulate``'s coordinator or a site) exited.

    ``exit_code`` is the child's own exit code; the parent exits with the same code, so a
    site that stopped on a data error makes ``dpfed simulate`` exit with the data-error code.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
