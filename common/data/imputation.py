"""A DP mean of the observed values of continuous columns, to impute missing values with.

``missing = "impute"`` needs a public value (docs/privacy.md, invariant 3: never one from the
data). Where no public value is known, a federation can learn one with a round of its own:
every site releases, per column, the sum of its *observed* values scaled to [-1, 1] by the
schema bounds and the number of observed values (:func:`observed_sums`, noised by
:func:`observed_sums_mechanism`); the coordinator adds the sites' releases and divides
(:func:`dp_means`, post-processing). The result is a public value the schema can name as
``impute`` (a new schema version, distributed like any schema change).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.validation import check_finite_array


def _continuous(schema: Schema, columns: Sequence[str]) -> list[ContinuousColumn]:
    out = []
    for name in columns:
        col = schema.column(name)
        if not isinstance(col, ContinuousColumn):
            raise ValidationError(f"column {name!r} is {col.type}; a mean imputation takes "
                                  "continuous or date columns")
        out.append(col)
    if not out:
        raise ValidationError("a mean imputation needs at least one column")
    return out


def observed_sums(tables: Iterable[EncodedTable], schema: Schema,
                  columns: Sequence[str]) -> np.ndarray:
    """Return ``[s_1 .. s_C, n_1 .. n_C]`` exactly (site side; never sent as it is).

    ``s_c`` is the sum over rows where column c is observed of ``(v - centre) / half_range``
    (in [-1, 1]), ``n_c`` the number of such rows. A value is missing where
    :meth:`EncodedTable.missing_mask` says so (``missing = "category"``).
    """
    cols = _continuous(schema, columns)
    out = np.zeros(2 * len(cols))
    for table in tables:
        for i, col in enumerate(cols):
            observed = ~table.missing_mask(col.name)
            v = table.columns[col.name][observed]
            out[i] += float(np.sum((v - col.center) / col.half_range))
            out[len(cols) + i] += float(np.count_nonzero(observed))
    return out


def observed_sums_mechanism(n_columns: int, epsilon: float, delta: float,
                            calibration: str = "analytic") -> GaussianMechanism:
    """Return the mechanism that releases :func:`observed_sums` of ``n_columns`` columns.

    Privacy
    -------
    Neighbouring relation: replace-one (``N_s`` public, one row replaced). Bounds: each
    observed value is scaled into [-1, 1] by the public schema bounds (values outside them were
    clipped by the encoding), a missing value contributes nothing. Sensitivity: per column,
    replacing an observed ``a`` by an observed ``b`` changes ``(s_c, n_c)`` by ``(b - a, 0)``,
    squared norm at most 4 (``a = -1``, ``b = 1``); replacing an observed value by a missing one
    changes it by ``(-a, -1)``, squared norm at most 2. Over C columns the L2 change is at most
    ``2 sqrt(C)``, attained by a row at every lower bound replaced by one at every upper bound.
    Calibration: Gaussian with L2 sensitivity ``2 sqrt(C)``
    (:func:`dpfed.common.privacy.mechanisms.gaussian_sigma`, analytic by default).
    """
    if isinstance(n_columns, bool) or not isinstance(n_columns, int) or n_columns < 1:
        raise ValidationError(f"n_columns must be an integer >= 1, got {n_columns!r}")
    return GaussianMechanism(epsilon, delta, 2.0 * math.sqrt(n_columns), calibration)


def dp_means(schema: Schema, columns: Sequence[str],
             noisy_releases: Sequence[np.ndarray]) -> dict[str, float]:
    """Coordinator step: the DP mean of each column's observed values, in its own units.

    Adds the sites' noisy ``[s, n]`` vectors, divides (a count below 1 is taken as 1), clips the
    scaled mean into [-1, 1] and maps it back with the public bounds (rounded for integer
    columns). Pure post-processing of the releases.
    """
    cols = _continuous(schema, columns)
    if not noisy_releases:
        raise ValidationError("dp_means needs at least one site's release")
    total = np.zeros(2 * len(cols))
    for release in noisy_releases:
        r = check_finite_array(release, "release", ndim=1)
        if r.shape != total.shape:
            raise ValidationError(f"a release must have shape {total.shape}, got {r.shape}")
        total += r
    means: dict[str, float] = {}
    for i, col in enumerate(cols):
        scaled = float(np.clip(total[i] / max(total[len(cols) + i], 1.0), -1.0, 1.0))
        value = col.center + col.half_range * scaled
        means[col.name] = float(min(max(round(value), col.min), col.max)) if col.integer \
            else value
    return means
