"""Exit codes of the dpfed binaries (``dpfed``, ``dpfed-site``, ``dpfed-aggregator``).

Scripts and service managers can tell failures apart by these numbers; each binary prints a
one-line reason on stderr before exiting with one of them.
"""

from __future__ import annotations

from dpfed.common import errors

OK = 0
#: An unexpected internal error (a bug: please report it with the log).
INTERNAL_ERROR = 1
#: Bad command-line usage (argparse's own code).
USAGE = 2
#: A configuration file or flag is missing or invalid.
CONFIG_ERROR = 3
#: A data file, table or schema cannot be read or does not match.
DATA_ERROR = 4
#: A certificate or key is missing, unreadable or does not chain to the federation CA.
CERTIFICATE_ERROR = 5
#: The coordinator could not be reached within the connect timeout.
COORDINATOR_UNREACHABLE = 6
#: The coordinator refused this site (unknown identity, schema mismatch, ...).
REJECTED_BY_COORDINATOR = 7
#: A job failed (quorum not reached, all sites refused, ...).
JOB_FAILED = 8
#: The privacy budget does not allow the request.
BUDGET_EXCEEDED = 9
#: Interrupted by SIGINT.
INTERRUPTED = 130


def for_error(exc: BaseException) -> int:
    """Return the exit code that reports ``exc`` (most specific class first)."""
    table: list[tuple[type[BaseException], int]] = [
        (errors.CertificateError, CERTIFICATE_ERROR),
        (errors.AuthenticationError, CERTIFICATE_ERROR),
        (errors.PermissionDeniedError, CERTIFICATE_ERROR),
        (errors.SchemaError, DATA_ERROR),
        (errors.DataError, DATA_ERROR),
        (errors.ConfigError, CONFIG_ERROR),
        (errors.CoordinatorUnavailableError, COORDINATOR_UNREACHABLE),
        (errors.JobFailedError, JOB_FAILED),
        (errors.QuorumError, JOB_FAILED),
        (errors.BudgetExceededError, BUDGET_EXCEEDED),
        (errors.NotFoundError, USAGE),
        (errors.ValidationError, USAGE),
        (KeyboardInterrupt, INTERRUPTED),
        (OSError, CONFIG_ERROR),
    ]
    for cls, code in table:
        if isinstance(exc, cls):
            return code
    return INTERNAL_ERROR
