"""What a site's row policy did, as a vector of counts that may leave the site only with noise.

The exact counts (:class:`~dpfed.common.data.encoding.EncodingReport`) stay at the site: in its
log and in ``dpfed-site check``. A coordinator that wants to know what every site's policy did
-- how many rows each dropped and why, how often each column is missing -- asks for them as a DP
release of :func:`policy_counts` with :func:`policy_counts_mechanism`, charged to the site's
ledger like any other release. :func:`dropped_fraction_warning` is the local check against a
public threshold.
"""

from __future__ import annotations

import math

import numpy as np

from dpfed.common.data.encoding import EncodingReport
from dpfed.common.data.schema import NominalColumn, Schema
from dpfed.common.privacy.mechanisms import GaussianMechanism

#: The row buckets of :func:`policy_counts`, in order (a dropped row is in exactly one).
DROP_BUCKETS: tuple[str, ...] = ("dropped: missing", "dropped: invalid",
                                 "dropped: out of range")


def policy_count_names(schema: Schema) -> tuple[str, ...]:
    """Names of the entries of :func:`policy_counts`, in order."""
    names = list(DROP_BUCKETS)
    names.extend(f"{c.name}: missing" for c in schema.columns)
    names.extend(f"{c.name}: other" for c in schema.columns
                 if isinstance(c, NominalColumn) and c.other)
    return tuple(names)


def policy_counts(report: EncodingReport, schema: Schema) -> np.ndarray:
    """Return the exact count vector of a whole pass (site side; never sent as it is).

    Entries (:func:`policy_count_names`): rows dropped for a missing, an invalid and an
    out-of-range value; then, per column, the rows where it is missing and, per nominal column
    with ``other``, the rows read as ``"other"`` -- over every row read, kept or not.
    """
    by_column = report.problems_by_column
    values = [report.dropped_missing, report.dropped_invalid, report.dropped_out_of_range]
    values.extend(by_column.get(c.name, {}).get("missing", 0) for c in schema.columns)
    values.extend(by_column.get(c.name, {}).get("other", 0) for c in schema.columns
                  if isinstance(c, NominalColumn) and c.other)
    return np.asarray(values, dtype=np.float64)


def policy_counts_sensitivity(schema: Schema) -> float:
    """L2 sensitivity of :func:`policy_counts` under replace-one: ``sqrt(2 + C + O)``.

    See :func:`policy_counts_mechanism` for the derivation.
    """
    n_other = sum(1 for c in schema.columns if isinstance(c, NominalColumn) and c.other)
    return math.sqrt(2 + len(schema.columns) + n_other)


def policy_counts_mechanism(schema: Schema, epsilon: float, delta: float,
                            calibration: str = "analytic") -> GaussianMechanism:
    """Return the mechanism that releases :func:`policy_counts` (it states its own cost).

    Privacy
    -------
    Neighbouring relation: replace-one on the rows the site *reads* (its table before the row
    policy): two tables with the same number of rows that differ in one row. (The kept rows'
    count ``N_s`` is public under the system's relation; the counts here are about the rows
    the policy removed, so they are protected as rows of the table read.) Each row adds 1 to
    at most one drop bucket (``encode_table`` assigns a dropped row to the first of missing,
    invalid, out of range) and, per column, 1 to at most one of that column's ``missing`` and
    ``other`` entries (a value is missing, or read as ``"other"``, or neither). Sensitivity:
    replacing row ``r`` by ``r'`` changes the drop buckets by at most ``e_i - e_j`` (squared
    norm 2) and, per column, each of its entries by at most 1 (squared norm 1 for a column
    without ``other``, 2 with it), so the L2 change is at most ``sqrt(2 + C + O)`` for C columns
    of which O have ``other``; this is attained when a row dropped for a missing value that is
    missing in every column can be replaced by one dropped as invalid whose other-columns all
    read ``"other"``. Calibration: Gaussian with that sensitivity
    (:func:`dpfed.common.privacy.mechanisms.gaussian_sigma`, analytic by default). Anything
    computed from the noisy vector (rates over the public ``N_s``, clipping at 0) is
    post-processing.
    """
    return GaussianMechanism(epsilon, delta, policy_counts_sensitivity(schema), calibration)


def dropped_fraction_warning(report: EncodingReport, threshold: float) -> str | None:
    """Return a warning when more than ``threshold`` of the rows read would be dropped.

    ``threshold`` is a public fraction chosen by the site operator (``[data]
    warn_dropped_fraction``); the message holds counts and column names only and stays at the
    site (its log and ``dpfed-site check``).
    """
    if report.rows_read == 0:
        return None
    dropped = report.rows_read - report.rows_kept
    if dropped <= threshold * report.rows_read:
        return None
    columns = sorted(name for name, counts in report.problems_by_column.items()
                     if counts.get("missing") or counts.get("invalid")
                     or counts.get("out_of_range"))
    return (f"{dropped} of {report.rows_read} rows ({dropped / report.rows_read:.1%}) would be "
            f"dropped, more than warn_dropped_fraction = {threshold:g} ({report.summary()}); "
            f"columns with problem values: {columns}. Every release would describe only the "
            "rows kept: keep rows with missing = \"category\" or \"impute\" in the schema, "
            "other = true for undeclared categories, or fix the data")
