"""A DP summary of a site's evaluation of a synthetic sample (what may leave the site).

A site whose policy allows it (``evaluation_summary = "dp"``) releases, with Gaussian noise
charged to its ledger, per column the TVD between its *training* rows and the sample
(``tvd``), and the shares of keyed training rows (``near_train``) and of held-out rows
(``near_holdout``, :mod:`dpfed.common.evaluation.holdout`) whose closest synthetic row is
within a threshold computed from the sample alone. ``near_train`` well above ``near_holdout``
is memorisation; :func:`excess_near_copies` estimates its share (post-processing).
Privacy (replace-one, the scaled vector ``(n_t tvd, k near_train, n_h near_holdout)`` has L2
sensitivity ``sqrt(d + 1)`` for any sample; analytic Gaussian): docs/synthesis.md, "A DP
summary back to the coordinator".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.synth.link_release import LinkHistogramAccumulator, histogram_sizes

#: Most training rows whose distance to the synthetic sample is compared (a keyed subsample).
MAX_COMPARED_ROWS = 20_000
#: Quantile of the synthetic rows' nearest-other-synthetic-row distances used as threshold.
NEAR_QUANTILE = 0.05


def summary_features(schema: Schema, table: EncodedTable) -> np.ndarray:
    """Return the rows on the public schema scaling (each row's features depend on it alone)."""
    return np.ascontiguousarray(UnitBallMap(schema).scaled(table))


def synthetic_threshold(synthetic_x: np.ndarray) -> float:
    """Return the 5th percentile of the synthetic rows' distances to their closest other one."""
    if synthetic_x.shape[0] < 2:
        raise ValidationError("the synthetic sample needs at least 2 rows")
    from scipy.spatial import cKDTree  # a slow import: on first use

    d, _ = cKDTree(synthetic_x).query(synthetic_x, k=2)
    return float(np.quantile(d[:, 1], NEAR_QUANTILE))


def excess_near_copies(near_train: float, near_holdout: float, *, n_train: int,
                       n_synthetic: int) -> float:
    """Return ``(near_train - near_holdout) * n_train / n_synthetic`` (post-processing).

    Each synthetic row that copies a training row makes at most one more training row "near";
    fresh rows of the same population raise both shares alike. About 1 for a model that
    copies its training rows, about 0 for one that does not.
    """
    return (near_train - near_holdout) * n_train / max(n_synthetic, 1)


def near_count(rows_x: np.ndarray, tree: Any, threshold: float) -> int:
    """Count the rows whose closest synthetic row is within ``threshold`` (inclusive)."""
    if rows_x.shape[0] == 0:
        return 0
    d, _ = tree.query(rows_x, k=1)
    return int(np.count_nonzero(d <= threshold))


def summary_sensitivity(n_columns: int) -> float:
    """L2 sensitivity of the scaled summary vector under replace-one: ``sqrt(d + 1)``."""
    if n_columns < 1:
        raise ValidationError("the summary needs at least one column")
    return math.sqrt(n_columns + 1)


@dataclass(frozen=True)
class ExactSummary:
    """The exact (un-noised) statistics at one site: site-internal, never sent.

    ``scaled`` is the vector the mechanism adds noise to (each coordinate moves by at most 1
    between neighbouring tables); the counts are public functions of ``N_s``.
    """

    scaled: np.ndarray
    n_train: int
    n_compared: int
    n_holdout: int
    threshold: float
    n_synthetic: int = 0

    @property
    def divisors(self) -> np.ndarray:
        """The public counts that turn ``scaled`` into the statistics."""
        d = self.scaled.shape[0] - 2
        return np.concatenate([np.full(d, float(self.n_train)),
                               [float(self.n_compared), float(self.n_holdout)]])


class SummaryAccumulator:
    """Stream the training rows; compare the compared subsample and the holdout at the end.

    Parameters
    ----------
    schema : Schema
    n_bins : int
        Public bins of continuous columns (the job's).
    synthetic : EncodedTable
        The coordinator's synthetic sample.
    """

    def __init__(self, schema: Schema, n_bins: int, synthetic: EncodedTable) -> None:
        self.schema = schema
        self.hist = LinkHistogramAccumulator(schema, n_bins)
        syn = LinkHistogramAccumulator(schema, n_bins)
        syn.add(synthetic)
        self.synthetic_props = syn.counts / float(synthetic.n_rows)
        self.sizes = histogram_sizes(schema, n_bins)
        syn_x = summary_features(schema, synthetic)
        self.threshold = synthetic_threshold(syn_x)
        from scipy.spatial import cKDTree  # a slow import: on first use

        self.tree = cKDTree(syn_x)
        self.n_synthetic = synthetic.n_rows
        self.near_train = 0
        self.n_compared = 0

    def add_training(self, table: EncodedTable, compared: np.ndarray) -> None:
        """Add one chunk of training rows; ``compared`` marks the rows of the compared subsample."""
        self.hist.add(table)
        if np.any(compared):
            part = table.take(compared)
            self.near_train += near_count(summary_features(self.schema, part), self.tree,
                                          self.threshold)
            self.n_compared += part.n_rows

    def finish(self, holdout: EncodedTable) -> ExactSummary:
        """Return the exact summary, given the held-out rows."""
        n_t = self.hist.n_rows
        if n_t < 1 or holdout.n_rows < 1 or self.n_compared < 1:
            raise ValidationError("the DP evaluation summary needs training and held-out rows")
        tvd = []
        start = 0
        for size in self.sizes:
            counts = self.hist.counts[start:start + size].astype(np.float64)
            q = self.synthetic_props[start:start + size]
            tvd.append(0.5 * float(np.abs(counts - n_t * q).sum()))
            start += size
        near_h = near_count(summary_features(self.schema, holdout), self.tree, self.threshold)
        scaled = np.array([*tvd, float(self.near_train), float(near_h)], dtype=np.float64)
        return ExactSummary(scaled, n_t, self.n_compared, holdout.n_rows, self.threshold,
                            self.n_synthetic)


def summary_mechanism(n_columns: int, epsilon: float, delta: float) -> GaussianMechanism:
    """Return the Gaussian mechanism of :func:`release_summary`.

    Privacy
    -------
    Replace-one; L2 sensitivity :func:`summary_sensitivity` (``sqrt(d + 1)``) of the scaled
    vector (module docstring); analytic Gaussian calibration for (epsilon, delta).
    """
    return GaussianMechanism(epsilon, delta, summary_sensitivity(n_columns))


def summary_cost(n_columns: int, epsilon: float, delta: float) -> PrivacyCost:
    """Return the ledger cost of one summary release."""
    return summary_mechanism(n_columns, epsilon, delta).cost()


def release_summary(exact: ExactSummary, *, epsilon: float, delta: float,
                    rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Add the noise and return (arrays, metadata) of the release.

    Arrays: ``tvd`` (d,) and ``near`` (2,) = (near_train, near_holdout), noisy. Metadata: the
    public counts, the threshold and each statistic's noise standard deviation.

    Privacy
    -------
    See :func:`summary_mechanism`: (epsilon, delta)-DP under replace-one.
    """
    d = exact.scaled.shape[0] - 2
    mech = summary_mechanism(d, epsilon, delta)
    noisy = mech.release(exact.scaled, rng) / exact.divisors
    meta = {"n_synthetic": exact.n_synthetic, "n_train": exact.n_train,
            "n_compared": exact.n_compared, "n_holdout": exact.n_holdout,
            "threshold": exact.threshold,
            "sigma_tvd": mech.sigma / exact.n_train,
            "sigma_near_train": mech.sigma / exact.n_compared,
            "sigma_near_holdout": mech.sigma / exact.n_holdout}
    return {"tvd": noisy[:d].copy(), "near": noisy[d:].copy()}, meta
