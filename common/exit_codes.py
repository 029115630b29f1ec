"""Exit codes of the dpfed binaries (``dpfed``, ``dpfed-site``, ``dpfed-aggregator``).

Scripts and service managers can tell failures apart by these numbers; each binary prints a
one-line reason on stderr before exiting with one of them. :data:`TABLE` is the one list of
them; ``docs/cli.md`` and the README print it, and a test keeps the three in step.
"""

from __future__ import annotations

from dpfed.common import errors

OK = 0
#: An unexpected internal error (a bug: please report it with the log).
INTERNAL_ERROR = 1
#: Bad command-line usage (argparse's own code), or a request the coordinator rejects as
#: invalid (a parameter out of range, an unknown job id).
USAGE = 2
#: A configuration file or flag is missing or invalid (also an output that cannot be written).
CONFIG_ERROR = 3
#: An input file (data, table, schema, model, result, query set, workload) is missing,
#: cannot be read or does not match.
DATA_ERROR = 4
#: A certificate or key is missing, unreadable or does not chain to the federation CA.
CERTIFICATE_ERROR = 5
#: The coordinator could not be reached within the connect timeout.
COORDINATOR_UNREACHABLE = 6
#: The coordinator refused this site (unknown identity, schema mismatch, ...).
REJECTED_BY_COORDINATOR = 7
#: A job failed (quorum not reached, sites timed out or refused, ...).
JOB_FAILED = 8
#: The privacy budget does not allow the request (also: a job every site refused for budget).
BUDGET_EXCEEDED = 9
#: The coordinator answered but fewer sites than ``--wait-sites N`` connected in time.
SITES_NOT_CONNECTED = 10
#: A signed ledger export does not verify (altered, truncated, reordered, or not signed by a
#: site certificate of the federation): ``dpfed audit verify``.
VERIFICATION_FAILED = 11
#: Interrupted by SIGINT.
INTERRUPTED = 130
#: The reader of standard output went away (``dpfed jobs | head``): stop quietly, as a
#: process killed by SIGPIPE would (128 + 13).
PIPE_CLOSED = 141

#: (code, name, meaning): the documented table, in order.
TABLE: tuple[tuple[int, str, str], ...] = (
    (OK, "OK", "success"),
    (INTERNAL_ERROR, "INTERNAL_ERROR", "unexpected internal error (a bug: please report it)"),
    (USAGE, "USAGE", "bad command-line usage, or a request the coordinator rejects as invalid"),
    (CONFIG_ERROR, "CONFIG_ERROR", "configuration file or flag missing or invalid"),
    (DATA_ERROR, "DATA_ERROR", "input file (data, schema, model, result, query set) missing, "
     "unreadable or not matching"),
    (CERTIFICATE_ERROR, "CERTIFICATE_ERROR",
     "certificate or key missing, unreadable, or not chaining to the federation CA"),
    (COORDINATOR_UNREACHABLE, "COORDINATOR_UNREACHABLE",
     "coordinator not reachable (down, wrong address, TLS handshake failed)"),
    (REJECTED_BY_COORDINATOR, "REJECTED_BY_COORDINATOR",
     "the coordinator refused this site (unknown identity, schema mismatch)"),
    (JOB_FAILED, "JOB_FAILED", "a job failed (quorum not reached, sites timed out or refused)"),
    (BUDGET_EXCEEDED, "BUDGET_EXCEEDED",
     "privacy budget exhausted (also when every refusing site refused for budget)"),
    (SITES_NOT_CONNECTED, "SITES_NOT_CONNECTED",
     "the coordinator is up but fewer sites than --wait-sites N connected in time"),
    (VERIFICATION_FAILED, "VERIFICATION_FAILED",
     "a signed ledger export does not verify (altered, truncated, or wrongly signed)"),
    (INTERRUPTED, "INTERRUPTED", "interrupted (Ctrl-C)"),
    (PIPE_CLOSED, "PIPE_CLOSED", "standard output closed by its reader (output piped into head)"),
)


def for_error(exc: BaseException) -> int:
    """Return the exit code that reports ``exc`` (most specific class first).

    A :class:`dpfed.common.errors.ProcessExitedError` passes on its child's code when that
    code is one of the table's.
    """
    if isinstance(exc, errors.ProcessExitedError):
        known = {code for code, _, _ in TABLE} - {OK}
        return exc.exit_code if exc.exit_code in known else INTERNAL_ERROR
    table: list[tuple[type[BaseException], int]] = [
        (errors.CertificateError, CERTIFICATE_ERROR),
        (errors.AuthenticationError, CERTIFICATE_ERROR),
        (errors.PermissionDeniedError, CERTIFICATE_ERROR),
        (errors.SchemaError, DATA_ERROR),
        (errors.DataError, DATA_ERROR),
        (errors.ConfigError, CONFIG_ERROR),
        (errors.SitesNotConnectedError, SITES_NOT_CONNECTED),
        (errors.SiteRejectedError, REJECTED_BY_COORDINATOR),
        (errors.VerificationError, VERIFICATION_FAILED),
        (errors.CoordinatorUnavailableError, COORDINATOR_UNREACHABLE),
        (errors.BudgetExceededError, BUDGET_EXCEEDED),
        (errors.JobFailedError, JOB_FAILED),
        (errors.QuorumError, JOB_FAILED),
        (errors.NotFoundError, USAGE),
        (errors.ValidationError, USAGE),
        (KeyboardInterrupt, INTERRUPTED),
        (BrokenPipeError, PIPE_CLOSED),
        (OSError, CONFIG_ERROR),
    ]
    for cls, code in table:
        if isinstance(exc, cls):
            return code
    return INTERNAL_ERROR
