"""Evaluate a synthetic table against the real rows it was made from: risk and utility.

**Evaluation, not a DP release.** :func:`evaluate_synthetic` reads real rows, so it runs at a
site (only a site holds real rows). The report it returns holds exact statistics of those
rows; it stays at the site unless the site operator chooses to share it, and nothing here is
charged to or released through the privacy ledger.

The individual metrics live in :mod:`dpfed.common.evaluation.disclosure` (seed 003's distances,
correlation
probability, ``M`` / ``M_best``; DCR; NNDR; the chunked nearest-neighbour search) and
:mod:`dpfed.common.evaluation.utility_metrics` (per-column TVD / KS, correlation-matrix error).
They are
re-exported here so callers can import everything from ``dpfed.common.evaluation.metrics``.

How :func:`evaluate_synthetic` encodes mixed types
--------------------------------------------------
Both tables are encoded with the schema (``dpfed.common.data.encoding.encode_table``), mapped to
numbers
by ``dpfed.common.pca.features.UnitBallMap(schema).scaled`` (continuous and ordinal columns to [-1,
1]
by the public bounds, nominal columns one-hot), and -- for the distance-based disclosure
metrics -- z-scored with the training rows' column means and standard deviations, as NNDR is
defined on z-scored columns. The same standardised features feed seed 003's ``M`` (d1 is
invariant to this scaling, the cosine in ``P`` is not). One-hot blocks make the covariance
singular, so d1 uses its pseudo-inverse. Marginals and correlations use the encoding directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.evaluation.disclosure import (
    DEFAULT_MAX_BLOCK_BYTES,
    KDTREE_MAX_DIM,
    MAX_BLOCK_BYTES_LIMIT,
    CorrelationMatch,
    DCRSummary,
    DisclosureRisk,
    MeanDistance,
    Neighbours,
    NNDRSummary,
    correlation_match,
    d1_squared,
    d2_squared,
    d3_squared,
    dcr_summary,
    disclosure_m,
    disclosure_m_best,
    disclosure_risk,
    distance_to_closest_record,
    nearest_neighbours,
    neighbour_distance_ratio,
    nndr,
    nndr_summary,
    standardize,
)
from dpfed.common.evaluation.utility_metrics import (
    CorrelationError,
    MarginalDistance,
    correlation_error,
    correlation_matrix,
    encoded_table,
    ks_statistic,
    marginal_distances,
    table_correlation_error,
    total_variation_distance,
)
from dpfed.common.pca.features import UnitBallMap

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BLOCK_BYTES",
    "KDTREE_MAX_DIM",
    "MAX_BLOCK_BYTES_LIMIT",
    "CorrelationError",
    "CorrelationMatch",
    "DCRSummary",
    "DisclosureRisk",
    "MarginalDistance",
    "MeanDistance",
    "NNDRSummary",
    "Neighbours",
    "SyntheticReport",
    "correlation_error",
    "correlation_match",
    "correlation_matrix",
    "d1_squared",
    "d2_squared",
    "d3_squared",
    "dcr_summary",
    "disclosure_m",
    "disclosure_m_best",
    "disclosure_risk",
    "distance_to_closest_record",
    "encoded_table",
    "evaluate_synthetic",
    "ks_statistic",
    "marginal_distances",
    "nearest_neighbours",
    "neighbour_distance_ratio",
    "nndr",
    "nndr_summary",
    "standardize",
    "table_correlation_error",
    "total_variation_distance",
]


def _mean_max(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.mean(values)), float(np.max(values))


@dataclass(frozen=True)
class SyntheticReport:
    """Risk and utility of one synthetic table (site-local evaluation; see the module docstring).

    Attributes
    ----------
    n_train, n_synthetic, n_holdout : int
        Rows used after encoding (``n_holdout`` 0 without a holdout).
    n_features : int
        Width of the numeric encoding (one-hot nominal columns count once per category).
    dcr : DCRSummary
        Distance to closest record, against train and (if given) holdout.
    nndr : NNDRSummary
        Nearest-neighbour distance ratio against the training rows.
    disclosure : DisclosureRisk
        Seed 003's ``M`` (d1) and ``M_best`` of the synthetic rows against the training rows.
    marginals : tuple of MarginalDistance
        Per-column TVD (ordinal, nominal) or KS (continuous), in schema order.
    mean_tvd, max_tvd, mean_ks, max_ks : float or None
        Averages and maxima over the columns of each kind (None when there is none).
    correlation : CorrelationError
        Correlation-matrix error on ``UnitBallMap(schema).scaled``.
    nearest_match_rate, correlation_match_rate : float or None
        Only for ``row_aligned=True`` (synthetic row i was made from training row i): the
        share of synthetic rows whose nearest training row, or whose most correlated training
        row (seed 003's ``argmax_j C_ij``), is their own source row -- a direct
        re-identification rate. A non-aligned generator scores about ``1 / n_train``.
    """

    n_train: int
    n_synthetic: int
    n_holdout: int
    n_features: int
    dcr: DCRSummary
    nndr: NNDRSummary
    disclosure: DisclosureRisk
    marginals: tuple[MarginalDistance, ...]
    mean_tvd: float | None
    max_tvd: float | None
    mean_ks: float | None
    max_ks: float | None
    correlation: CorrelationError
    nearest_match_rate: float | None = None
    correlation_match_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable data (nested dicts, lists, floats, ints, None)."""
        return {
            "n_train": self.n_train,
            "n_synthetic": self.n_synthetic,
            "n_holdout": self.n_holdout,
            "n_features": self.n_features,
            "dcr": self.dcr.to_dict(),
            "nndr": self.nndr.to_dict(),
            "disclosure": self.disclosure.to_dict(),
            "marginals": [m.to_dict() for m in self.marginals],
            "mean_tvd": self.mean_tvd,
            "max_tvd": self.max_tvd,
            "mean_ks": self.mean_ks,
            "max_ks": self.max_ks,
            "correlation": self.correlation.to_dict(),
            "nearest_match_rate": self.nearest_match_rate,
            "correlation_match_rate": self.correlation_match_rate,
        }


def evaluate_synthetic(real_train: pd.DataFrame | EncodedTable,
                       synthetic: pd.DataFrame | EncodedTable, schema: Schema, *,
                       holdout: pd.DataFrame | EncodedTable | None = None,
                       row_aligned: bool = False,
                       max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                       n_jobs: int = 1) -> SyntheticReport:
    """Evaluate ``synthetic`` against the training rows (and a holdout): risk and utility.

    Parameters
    ----------
    real_train : pandas.DataFrame or EncodedTable
        The real rows the synthesizer was fitted on (at least 3 after encoding: NNDR needs two
        neighbours and the seed's covariance two rows).
    synthetic : pandas.DataFrame or EncodedTable
        The synthetic rows, typed by the same schema.
    schema : Schema
        The federation schema.
    holdout : pandas.DataFrame or EncodedTable, optional
        Real rows the synthesizer never saw; enables the DCR-overfitting figures.
    row_aligned : bool
        Synthetic row i was generated from training row i (the factor-model synthesizer's
        row-aligned mode); adds the direct re-identification rates. Needs equal row counts.
    max_block_bytes : int
        Memory bound of one block of the pairwise searches (see
        :mod:`dpfed.common.evaluation.disclosure`).
    n_jobs : int
        Worker threads of the pairwise searches (default 1).

    Returns
    -------
    SyntheticReport

    Notes
    -----
    Cost: two passes over all (synthetic, train) pairs -- the top-2 nearest-neighbour search
    (DCR and NNDR) and seed 003's correlation search -- plus, with a holdout, the
    synthetic→holdout and holdout→train searches; each is chunked so memory stays
    O((n + m) p) plus one block.
    """
    train_enc = encoded_table(real_train, schema, name="real_train")
    syn_enc = encoded_table(synthetic, schema, name="synthetic")
    hold_enc = None if holdout is None else encoded_table(holdout, schema, name="holdout")
    if train_enc.n_rows < 3:
        raise ValidationError(
            f"real_train needs at least 3 usable rows, got {train_enc.n_rows}")
    if syn_enc.n_rows < 2:
        raise ValidationError(
            f"synthetic needs at least 2 usable rows (for its correlations), got {syn_enc.n_rows}")
    if row_aligned and syn_enc.n_rows != train_enc.n_rows:
        raise ValidationError(
            f"row_aligned needs as many synthetic rows as training rows, "
            f"got {syn_enc.n_rows} and {train_enc.n_rows}")
    logger.info("[metrics.evaluate_synthetic] train %d rows, synthetic %d rows, holdout %s rows",
                train_enc.n_rows, syn_enc.n_rows, None if hold_enc is None else hold_enc.n_rows)

    # Numeric encoding by the public schema, then z-scored with the training rows' statistics.
    fmap = UnitBallMap(schema)
    train_x = fmap.scaled(train_enc)
    syn_x = fmap.scaled(syn_enc)
    parts = [train_x, syn_x] if hold_enc is None else [train_x, syn_x, fmap.scaled(hold_enc)]
    z = standardize(*parts)
    train_z, syn_z = z[0], z[1]
    options: dict[str, Any] = {"max_block_bytes": max_block_bytes, "n_jobs": n_jobs}

    # DCR and NNDR from one top-2 search of synthetic rows among training rows.
    nb = nearest_neighbours(syn_z, train_z, k=2, **options)
    train_dcr = nb.distances[:, 0]
    if hold_enc is None:
        dcr = DCRSummary.from_distances(train_dcr, train_enc.n_rows)
    else:
        hold_z = z[2]
        dcr = DCRSummary.from_distances(
            train_dcr, train_enc.n_rows,
            holdout_dcr=distance_to_closest_record(syn_z, hold_z, **options),
            holdout_to_train_dcr=distance_to_closest_record(hold_z, train_z, **options),
        )
    nndr_stats = NNDRSummary.from_ratios(neighbour_distance_ratio(nb))

    # Seed 003 on the same features: M (d1) and M_best, synthetic rows as the masked A¹.
    match = correlation_match(train_z, syn_z, **options)
    risk = disclosure_risk(train_z, syn_z, distance="d1", match=match, **options)
    nearest_rate = corr_rate = None
    if row_aligned:
        own = np.arange(syn_enc.n_rows)
        nearest_rate = float(np.mean(nb.indices[:, 0] == own))
        corr_rate = float(np.mean(match.best_match == own))

    # Utility: marginals and correlations.
    marginals = marginal_distances(train_enc, syn_enc, schema)
    mean_tvd, max_tvd = _mean_max([m.value for m in marginals if m.statistic == "tvd"])
    mean_ks, max_ks = _mean_max([m.value for m in marginals if m.statistic == "ks"])
    corr = correlation_error(train_x, syn_x)
    return SyntheticReport(
        n_train=train_enc.n_rows, n_synthetic=syn_enc.n_rows,
        n_holdout=0 if hold_enc is None else hold_enc.n_rows, n_features=fmap.n_features,
        dcr=dcr, nndr=nndr_stats, disclosure=risk, marginals=marginals,
        mean_tvd=mean_tvd, max_tvd=max_tvd, mean_ks=mean_ks, max_ks=max_ks,
        correlation=corr, nearest_match_rate=nearest_rate, correlation_match_rate=corr_rate,
    )
