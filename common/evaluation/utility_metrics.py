"""Utility metrics of synthetic tables: per-column marginal distances and correlation error.

**These are evaluations, not DP releases.** They compare real rows with synthetic rows, so
they run at a site; their exact values stay there unless the site operator shares them.

* Marginals, per schema column: total variation distance ``½ Σ_k |p_k − q_k|`` between the
  category frequencies of ordinal and nominal columns, and the two-sample Kolmogorov–Smirnov
  statistic ``sup_x |F_real(x) − F_syn(x)|`` for continuous columns (the same statistic as
  ``scipy.stats.ks_2samp``). Both lie in [0, 1]; 0 is a perfect match.
* Correlations: the Pearson correlation matrices of a numeric encoding of the two tables and
  the Frobenius, largest and mean absolute difference of their off-diagonal entries. For mixed
  types the encoding is ``dpfed.common.pca.features.UnitBallMap(schema).scaled``: continuous and
  ordinal
  columns scaled to [-1, 1] by the schema, nominal columns one-hot.

Tables are pandas DataFrames (or already encoded :class:`dpfed.common.data.encoding.EncodedTable`)
typed
by a :class:`dpfed.common.data.schema.Schema`; :func:`dpfed.common.data.encoding.encode_table`
turns them into codes
with its default row policy (rows with missing or invalid values dropped, out-of-range
continuous values clipped to the schema bounds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from dpfed.common.data.encoding import EncodedTable, encode_table
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.validation import check_finite_array, check_int

__all__ = [
    "CorrelationError",
    "MarginalDistance",
    "correlation_error",
    "correlation_matrix",
    "encoded_table",
    "ks_statistic",
    "marginal_distances",
    "table_correlation_error",
    "total_variation_distance",
]


def encoded_table(table: pd.DataFrame | EncodedTable, schema: Schema, *,
                  name: str = "table") -> EncodedTable:
    """Return ``table`` encoded against ``schema`` (DataFrames go through ``encode_table``).

    Raises
    ------
    ValidationError
        ``table`` is neither a DataFrame nor an EncodedTable, was encoded with another schema,
        or has no usable rows.
    """
    if isinstance(table, EncodedTable):
        if table.schema.digest() != schema.digest():
            raise ValidationError(f"{name} was encoded with a different schema")
        enc = table
    elif isinstance(table, pd.DataFrame):
        enc, _ = encode_table(schema, table, source=name)
    else:
        raise ValidationError(
            f"{name} must be a pandas DataFrame or an EncodedTable, got {type(table).__name__}")
    if enc.n_rows == 0:
        raise ValidationError(f"{name} has no usable rows (empty, or every row was dropped "
                              "for missing or invalid values)")
    return enc


def _codes(values: Any, name: str, n_categories: int) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValidationError(f"{name} must be 1-dimensional, got shape {a.shape}")
    if a.size == 0:
        raise ValidationError(f"{name} must not be empty")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValidationError(f"{name} must hold integer category codes, got dtype {a.dtype}")
    if a.min() < 0 or a.max() >= n_categories:
        raise ValidationError(
            f"{name} codes must be in 0..{n_categories - 1}, got range {a.min()}..{a.max()}")
    return a


def total_variation_distance(real_codes: Any, synthetic_codes: Any, n_categories: int) -> float:
    """TVD ``½ Σ_k |p_k − q_k|`` between the category frequencies of two code arrays.

    Parameters
    ----------
    real_codes, synthetic_codes : array_like of int
        Codes ``0..n_categories-1`` (as produced by ``encode_table``).
    n_categories : int
        Number of categories (>= 1).
    """
    q = check_int(n_categories, "n_categories", minimum=1)
    r = _codes(real_codes, "real_codes", q)
    s = _codes(synthetic_codes, "synthetic_codes", q)
    p_real = np.bincount(r, minlength=q) / r.size
    p_syn = np.bincount(s, minlength=q) / s.size
    return float(0.5 * np.abs(p_real - p_syn).sum())


def ks_statistic(real: Any, synthetic: Any) -> float:
    """Two-sample Kolmogorov–Smirnov statistic ``sup_x |F_real(x) − F_syn(x)|``.

    Equal to ``scipy.stats.ks_2samp(real, synthetic).statistic``; computed from the two sorted
    samples in O((n + m) log(n + m)).
    """
    r = np.sort(check_finite_array(real, "real", ndim=1))
    s = np.sort(check_finite_array(synthetic, "synthetic", ndim=1))
    if r.size == 0 or s.size == 0:
        raise ValidationError(
            f"real and synthetic must not be empty, got {r.size} and {s.size} values")
    points = np.concatenate([r, s])
    cdf_r = np.searchsorted(r, points, side="right") / r.size
    cdf_s = np.searchsorted(s, points, side="right") / s.size
    return float(np.max(np.abs(cdf_r - cdf_s)))


@dataclass(frozen=True)
class MarginalDistance:
    """One column's marginal distance: ``statistic`` is "tvd" or "ks", ``value`` in [0, 1]."""

    column: str
    column_type: str
    statistic: str
    value: float

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return asdict(self)


def marginal_distances(real: pd.DataFrame | EncodedTable, synthetic: pd.DataFrame | EncodedTable,
                       schema: Schema) -> tuple[MarginalDistance, ...]:
    """Per-column marginal distance between a real and a synthetic table, in schema order.

    TVD for ordinal and nominal columns (over the schema's levels/categories), KS for
    continuous columns.
    """
    r = encoded_table(real, schema, name="real")
    s = encoded_table(synthetic, schema, name="synthetic")
    out: list[MarginalDistance] = []
    for col in schema.columns:
        rv, sv = r.columns[col.name], s.columns[col.name]
        if isinstance(col, ContinuousColumn):
            out.append(MarginalDistance(col.name, col.type, "ks", ks_statistic(rv, sv)))
        else:
            q = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
            out.append(MarginalDistance(col.name, col.type, "tvd",
                                        total_variation_distance(rv, sv, q)))
    return tuple(out)


def correlation_matrix(data: Any) -> np.ndarray:
    """Pearson correlation matrix of the columns of ``data`` (n×p, n >= 2).

    A constant column has no defined correlation; here it correlates 0 with every other column
    (and 1 with itself), so a constant column compared with a varying one counts as an error.
    """
    x = check_finite_array(data, "data", ndim=2)
    if x.shape[0] < 2 or x.shape[1] == 0:
        raise ValidationError(
            f"data needs at least 2 rows and 1 column for a correlation matrix, "
            f"got shape {x.shape}")
    c = x - x.mean(axis=0)
    cov = c.T @ c
    sd = np.sqrt(np.diag(cov))
    inv = np.zeros_like(sd)
    nz = sd > 0
    inv[nz] = 1.0 / sd[nz]
    corr: np.ndarray = cov * inv[:, None] * inv[None, :]
    np.clip(corr, -1.0, 1.0, out=corr)
    np.fill_diagonal(corr, 1.0)
    return corr


@dataclass(frozen=True)
class CorrelationError:
    """Differences between two correlation matrices (off-diagonal entries only).

    ``frobenius`` is ``‖R_real − R_syn‖_F`` (the diagonal is 1 in both); ``max_abs`` and
    ``mean_abs`` are the largest and mean absolute difference over pairs i < j.
    """

    frobenius: float
    max_abs: float
    mean_abs: float
    n_features: int

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return asdict(self)


def correlation_error(real: Any, synthetic: Any) -> CorrelationError:
    """Compare the correlation matrices of two numeric tables with the same columns."""
    r = correlation_matrix(real)
    s = correlation_matrix(synthetic)
    if r.shape != s.shape:
        raise ValidationError(
            f"real and synthetic must have the same number of columns, "
            f"got {r.shape[0]} and {s.shape[0]}")
    diff = r - s
    p = r.shape[0]
    iu = np.triu_indices(p, k=1)
    off = np.abs(diff[iu])
    return CorrelationError(
        frobenius=float(np.linalg.norm(diff)),
        max_abs=float(off.max()) if off.size else 0.0,
        mean_abs=float(off.mean()) if off.size else 0.0,
        n_features=p,
    )


def table_correlation_error(real: pd.DataFrame | EncodedTable,
                            synthetic: pd.DataFrame | EncodedTable,
                            schema: Schema) -> CorrelationError:
    """Correlation error on the numeric encoding ``UnitBallMap(schema).scaled`` of both tables."""
    r = encoded_table(real, schema, name="real")
    s = encoded_table(synthetic, schema, name="synthetic")
    fmap = UnitBallMap(schema)
    return correlation_error(fmap.scaled(r), fmap.scaled(s))
