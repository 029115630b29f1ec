"""DP one-way marginals that fit the mixed-type links: histograms and continuous moments.

The threshold and probit links of the factor-model synthesizer (seed 000, Alg. 2) are
data-derived, so every statistic they are fitted from is a DP release (docs/algorithms.md,
"Mixed-type
links"). The work splits into two parties:

Site (holds rows, spends budget)
    :func:`release_marginals` releases, for every ordinal and nominal column, its histogram
    of codes with exact discrete Laplace noise, and for every continuous column (when asked)
    the sums ``(sum v, sum v^2)`` of its values scaled to ``v in [-1, 1]`` by the schema
    bounds with (floating-point) Laplace noise. Every entry gets the same noise scale
    ``Delta_1 / epsilon`` with ``Delta_1`` the L1 sensitivity of the whole vector under the
    system's neighbouring relation, replace-one with ``N_s`` public (docs/privacy.md).
Coordinator (sees only releases)
    :func:`sum_releases` adds the sites' noisy vectors (post-processing);
    :func:`proportions_from_counts` and :func:`mean_variance_from_moments` turn the sums into
    a valid probability vector and a (mean, variance) pair.

Noise grade: histogram counts are integers and get *exact* discrete Laplace noise
(:class:`dpfed.common.privacy.exact_samplers.DiscreteLaplaceMechanism`, CKS 2020 Alg. 2), so the
released
counts are integers with exactly the stated distribution. Its uniform integers come from the
caller's ``numpy.random.Generator`` (:class:`GeneratorSource`; in production a fresh
generator seeded from ``os.urandom``), so seeded tests are reproducible. The continuous
moments are real numbers and get floating-point Laplace noise from the same generator (the
textbook mechanism; Mironov's CCS 2012 low-order-bit weakness applies to them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.exact_samplers import DiscreteLaplaceMechanism
from dpfed.common.privacy.mechanisms import LaplaceMechanism
from dpfed.common.validation import check_epsilon, check_int, check_nonnegative, check_probability

#: L1 sensitivity of one histogram of codes under replace-one row: one cell loses 1, another
#: gains 1 (its L2 sensitivity is sqrt(2)).
HISTOGRAM_SENSITIVITY = 2.0
#: L1 sensitivity of ``(sum v, sum v^2)`` with ``v in [-1, 1]`` under replace-one row:
#: ``max |v - w| (1 + |v + w|) = 9/4`` over ``v, w in [-1, 1]``, attained at v = 1, w = -1/2.
MOMENTS_SENSITIVITY = 2.25


def _categorical(schema: Schema) -> tuple[OrdinalColumn | NominalColumn, ...]:
    return tuple(c for c in schema.columns if not isinstance(c, ContinuousColumn))


def _continuous(schema: Schema) -> tuple[ContinuousColumn, ...]:
    return tuple(c for c in schema.columns if isinstance(c, ContinuousColumn))


def _n_cells(col: OrdinalColumn | NominalColumn) -> int:
    return col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories


def marginals_sensitivity(schema: Schema, *, moments: bool = True) -> float:
    """L1 sensitivity of the whole marginal vector under replace-one row (``N`` public).

    Replacing a row moves it from one cell to another in each categorical column's histogram
    (L1 change 2 per histogram, 0 if the cell is the same) and changes each continuous
    column's ``(sum v, sum v^2)`` from ``(v, v^2)`` to ``(w, w^2)``: L1 change
    ``|v - w| (1 + |v + w|) <= 9/4`` (with ``a = |v - w|``, ``|v + w| <= 2 - a``, so
    ``a (3 - a) <= 9/4``; attained at v = 1, w = -1/2). The columns are independent, so the
    worst row pair attains every term at once: ``Delta_1 = 2 n_categorical + 9/4
    n_continuous`` (the second term only when ``moments``). Returns 0.0 when nothing would be
    released.
    """
    n_cont = len(_continuous(schema)) if moments else 0
    return HISTOGRAM_SENSITIVITY * len(_categorical(schema)) + MOMENTS_SENSITIVITY * n_cont


class GeneratorSource:
    """Adapt a ``numpy.random.Generator`` to the ``randbelow(n)`` interface of the exact samplers.

    ``randbelow(n)`` is exactly uniform on ``[0, n)`` for any Python int ``n >= 1``: up to
    2^63 by ``Generator.integers``, beyond that by rejection from ``ceil(log2 n)`` random bits.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def randbelow(self, n: int, /) -> int:
        """Return a uniform integer in ``[0, n)``."""
        if n < 1:
            raise ValidationError(f"randbelow needs n >= 1, got {n}")
        if n <= 1 << 63:
            return int(self._rng.integers(0, n, dtype=np.uint64))
        bits = (n - 1).bit_length()
        n_bytes = (bits + 7) // 8
        while True:
            x = int.from_bytes(self._rng.bytes(n_bytes), "little") >> (8 * n_bytes - bits)
            if x < n:
                return x


def split_marginals_epsilon(schema: Schema, epsilon: float, *,
                            moments: bool = True) -> tuple[float, float]:
    """Split ``epsilon`` between the histograms and the moments in proportion to sensitivity.

    Returns ``(epsilon_histograms, epsilon_moments)``; both parts then have the same noise
    scale ``Delta_1 / epsilon`` (:func:`marginals_sensitivity`), which is what one Laplace
    mechanism on the concatenated vector would give. A part with nothing to release gets 0.
    """
    eps = check_epsilon(epsilon)
    total = marginals_sensitivity(schema, moments=moments)
    if total == 0.0:
        raise ValidationError(
            "no marginal statistics to release: the schema has no ordinal or nominal column "
            "and moments=False")
    hist = HISTOGRAM_SENSITIVITY * len(_categorical(schema))
    return eps * hist / total, eps * (total - hist) / total


def histogram_mechanism(schema: Schema, epsilon: float) -> DiscreteLaplaceMechanism:
    """Return the exact discrete Laplace mechanism for all categorical histograms together.

    Privacy
    -------
    Neighbouring relation: replace-one row at this site (``N`` public). Bounds: codes lie in
    ``0..M-1`` (schema levels/categories). Sensitivity: replacing a row moves one count down
    and another up in each of the ``n_categorical`` histograms, so the concatenated count
    vector moves by ``Delta_1 = 2 n_categorical`` in L1. Calibration: discrete Laplace of
    scale ``Delta_1 / epsilon`` on every cell, pure epsilon-DP (exact sampler, CKS 2020
    Alg. 2).
    """
    n_cat = len(_categorical(schema))
    if n_cat == 0:
        raise ValidationError("the schema has no ordinal or nominal column to histogram")
    return DiscreteLaplaceMechanism(check_epsilon(epsilon), HISTOGRAM_SENSITIVITY * n_cat)


def moments_mechanism(schema: Schema, epsilon: float) -> LaplaceMechanism:
    """Return the Laplace mechanism for every continuous column's ``(sum v, sum v^2)``.

    Privacy
    -------
    Neighbouring relation: replace-one row at this site; ``N`` is public (docs/privacy.md).
    Bounds: encoding clips values to the schema's ``[min, max]``; ``v = (y - centre) /
    half_range in [-1, 1]``. Sensitivity: replacing a row changes each continuous column's
    pair by ``(v - w, v^2 - w^2)``, L1 norm ``|v - w| (1 + |v + w|) <= 9/4``
    (:data:`MOMENTS_SENSITIVITY`), so ``Delta_1 = 9/4 n_continuous``. Calibration: Laplace of
    scale ``Delta_1 / epsilon`` on every entry, pure epsilon-DP (floating-point Laplace).
    """
    n_cont = len(_continuous(schema))
    if n_cont == 0:
        raise ValidationError("the schema has no continuous column")
    return LaplaceMechanism(check_epsilon(epsilon), MOMENTS_SENSITIVITY * n_cont)


def marginals_cost(schema: Schema, epsilon: float, *, moments: bool = True) -> PrivacyCost:
    """Privacy cost of :func:`release_marginals` (computable before any noise is drawn).

    The histograms and the moments each cost their share of ``epsilon``
    (:func:`split_marginals_epsilon`); composed, they cost ``epsilon``.
    """
    eps_hist, eps_mom = split_marginals_epsilon(schema, epsilon, moments=moments)
    costs = []
    if eps_hist > 0:
        costs.append(histogram_mechanism(schema, eps_hist).cost())
    if eps_mom > 0:
        costs.append(moments_mechanism(schema, eps_mom).cost())
    return costs[0] if len(costs) == 1 else PrivacyCost.total(costs)


@dataclass(frozen=True, eq=False)
class MarginalRelease:
    """What one site sends (or the coordinator's sum of several sites' releases).

    Attributes
    ----------
    counts : Mapping[str, ndarray]
        Noisy histogram of codes per ordinal/nominal column (integer values stored as
        float64; may be negative).
    moments : Mapping[str, ndarray]
        Per continuous column, noisy ``[sum v, sum v^2]`` with ``v`` scaled to [-1, 1] by
        the schema bounds (empty when moments were not released).
    n_rows : int
        Public row count (``N_s``, or the sum over sites).
    noise_scale : float
        Laplace scale of every entry at one site (for the coordinator's error estimates).
    n_sites : int
        How many site releases were summed into this one.
    """

    counts: Mapping[str, np.ndarray]
    moments: Mapping[str, np.ndarray]
    n_rows: int
    noise_scale: float
    n_sites: int = 1


def _scaled(col: ContinuousColumn, values: np.ndarray) -> np.ndarray:
    v = (np.asarray(values, dtype=np.float64) - col.center) / col.half_range
    return np.clip(v, -1.0, 1.0)  # encoding already clipped; guard against rounding


def exact_marginals(table: EncodedTable, *, moments: bool = True) -> MarginalRelease:
    """Return the un-noised statistics of :func:`release_marginals` (site-internal, never sent).

    Used by :func:`release_marginals` and by tests of the non-private limit.
    """
    counts: dict[str, np.ndarray] = {}
    sums: dict[str, np.ndarray] = {}
    for col in table.schema.columns:
        values = table.columns[col.name]
        if isinstance(col, ContinuousColumn):
            if moments:
                v = _scaled(col, values)
                sums[col.name] = np.array([v.sum(), np.dot(v, v)], dtype=np.float64)
        else:
            counts[col.name] = np.bincount(values, minlength=_n_cells(col)).astype(np.float64)
    return MarginalRelease(counts, sums, table.n_rows, 0.0)


def release_marginals(table: EncodedTable, *, epsilon: float, rng: np.random.Generator,
                      moments: bool = True) -> tuple[MarginalRelease, PrivacyCost]:
    """Site step: DP histograms of every categorical column (+ continuous moments).

    Parameters
    ----------
    table : EncodedTable
        This site's encoded rows (continuous values already within the schema bounds).
    epsilon : float
        Budget for the whole release.
    rng : numpy.random.Generator
        Noise source (also drives the exact discrete sampler via :class:`GeneratorSource`).
    moments : bool
        Also release ``(sum v, sum v^2)`` per continuous column (needed for DP
        mean/variance standardisation; not needed when the links use the schema bounds).

    Returns
    -------
    (MarginalRelease, PrivacyCost)

    Privacy
    -------
    Replace-one row with ``N`` public (docs/privacy.md). ``epsilon`` is split by
    :func:`split_marginals_epsilon`: the histograms (:func:`histogram_mechanism`: exact
    discrete Laplace, ``Delta_1 = 2 n_categorical``) and the moments
    (:func:`moments_mechanism`: Laplace, ``Delta_1 = 9/4 n_continuous``) both get scale
    ``(2 n_categorical + 9/4 n_continuous) / epsilon``; by basic composition the release is
    epsilon-DP. The row count is public under the relation.
    """
    eps_hist, eps_mom = split_marginals_epsilon(table.schema, epsilon, moments=moments)
    exact = exact_marginals(table, moments=moments)
    costs: list[PrivacyCost] = []
    counts: dict[str, np.ndarray] = {}
    sums: dict[str, np.ndarray] = {}
    scale = 0.0
    if eps_hist > 0:
        hist = histogram_mechanism(table.schema, eps_hist)
        source = GeneratorSource(rng)
        for name, cells in exact.counts.items():
            noisy = hist.release_many([int(c) for c in cells], source)
            counts[name] = np.asarray(noisy, dtype=np.float64)
        costs.append(hist.cost())
        scale = float(hist.scale)
    if eps_mom > 0:
        mom = moments_mechanism(table.schema, eps_mom)
        sums = {k: mom.release(v, rng) for k, v in exact.moments.items()}
        costs.append(mom.cost())
        scale = mom.scale
    cost = costs[0] if len(costs) == 1 else PrivacyCost.total(costs)
    return MarginalRelease(counts, sums, table.n_rows, scale), cost


def sum_releases(releases: Sequence[MarginalRelease]) -> MarginalRelease:
    """Coordinator step: add the sites' noisy statistics (post-processing, no budget)."""
    if not releases:
        raise ValidationError("sum_releases needs at least one site's release")
    first = releases[0]
    for i, r in enumerate(releases):
        if set(r.counts) != set(first.counts) or set(r.moments) != set(first.moments):
            raise ValidationError(f"release {i} has different columns than release 0")
        for k, v in r.counts.items():
            if v.shape != first.counts[k].shape:
                raise ValidationError(
                    f"release {i}: histogram of {k!r} has {v.shape[0]} cells, "
                    f"release 0 has {first.counts[k].shape[0]}")
    counts = {k: np.sum([r.counts[k] for r in releases], axis=0) for k in first.counts}
    sums = {k: np.sum([r.moments[k] for r in releases], axis=0) for k in first.moments}
    return MarginalRelease(counts, sums, sum(r.n_rows for r in releases),
                           max(r.noise_scale for r in releases),
                           sum(r.n_sites for r in releases))


def proportions_from_counts(counts: np.ndarray, *, min_proportion: float = 1e-4) -> np.ndarray:
    """Turn noisy counts into a probability vector with every entry >= ``min_proportion``.

    Post-processing of a DP histogram: negative counts are set to 0, the rest normalised
    (uniform if nothing positive is left), then mixed with the uniform distribution just
    enough that every proportion is at least ``min_proportion``. The floor keeps every threshold
    ``Phi^{-1}(cumulative proportion)`` finite and every latent interval non-empty, so a
    category seen in the data but wiped out by noise can still be mapped to the latent space.

    Parameters
    ----------
    counts : ndarray (M,)
        Noisy counts (may be negative or zero).
    min_proportion : float
        Floor in [0, 1/M).
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] < 2 or not np.all(np.isfinite(c)):
        raise ValidationError(f"counts must be a finite 1-d array of >= 2 cells, got {c.shape}")
    floor = check_nonnegative(min_proportion, "min_proportion")
    if floor * c.shape[0] >= 1.0:
        raise ValidationError(
            f"min_proportion must be < 1/{c.shape[0]} for {c.shape[0]} cells, got {floor!r}")
    c = np.clip(c, 0.0, None)
    total = c.sum()
    p = c / total if total > 0 else np.full(c.shape, 1.0 / c.shape[0])
    low = float(p.min())
    if low < floor:
        # Smallest mixing with the uniform distribution that lifts every cell to the floor:
        # p' = (1 - a) p + a / M, with a = (floor - min p) / (1/M - min p) in (0, 1).
        uniform = 1.0 / c.shape[0]
        a = (floor - low) / (uniform - low)
        p = (1.0 - a) * p + a * uniform
    return np.asarray(p)


def mean_variance_from_moments(moments: np.ndarray, n_rows: int, *,
                               min_variance: float = 1e-4,
                               noise_scale: float = 0.0) -> tuple[float, float]:
    """Turn noisy ``[sum v, sum v^2]`` into ``(mean, variance)`` of ``v in [-1, 1]``.

    Post-processing: ``mean = S1/N`` clipped to [-1, 1]; ``variance = S2/N - mean^2``
    clipped to ``[floor, 1]`` with ``floor = max(min_variance, 2 noise_scale / N)``.

    The noise-aware floor matters: ``S2/N`` carries Laplace noise of scale ``b/N``, and when
    that is comparable to the variance the difference can come out tiny or negative. An
    underestimated variance inflates the standardised latent coordinate without bound (one
    column then dominates the DP-PCA and the clipped rows), whereas an overestimate only
    shrinks it; so the estimate is never allowed below about 1.4 noise standard deviations.
    ``noise_scale`` is the Laplace scale of each sum (public: epsilon and the schema fix it;
    for a sum over S sites pass ``b sqrt(S)``).
    """
    m = np.asarray(moments, dtype=np.float64)
    if m.shape != (2,) or not np.all(np.isfinite(m)):
        raise ValidationError(f"moments must be a finite array of shape (2,), got {m.shape}")
    n = check_int(n_rows, "n_rows", minimum=1)
    floor = max(check_probability(min_variance, "min_variance"),
                2.0 * check_nonnegative(noise_scale, "noise_scale") / n)
    mean = min(max(float(m[0]) / n, -1.0), 1.0)
    var = float(m[1]) / n - mean * mean
    return mean, min(max(var, min(floor, 1.0)), 1.0)


def dp_histogram(codes: np.ndarray, n_levels: int, *, epsilon: float,
                 rng: np.random.Generator) -> tuple[np.ndarray, PrivacyCost]:
    """DP histogram of one column's codes (a single-column convenience).

    Returns integer-valued noisy counts (float64) and the cost.

    Privacy
    -------
    Replace-one row (``N`` public) moves one count down and another up: ``Delta_1 = 2``
    (L2 ``sqrt(2)``). Exact discrete Laplace of scale ``2/epsilon`` on every cell,
    epsilon-DP.
    """
    m = check_int(n_levels, "n_levels", minimum=1)
    c = np.asarray(codes)
    if c.size and (c.min() < 0 or c.max() >= m):
        raise ValidationError(f"codes must lie in 0..{m - 1}")
    mech = DiscreteLaplaceMechanism(check_epsilon(epsilon), HISTOGRAM_SENSITIVITY)
    exact = np.bincount(c.astype(np.int64), minlength=m)
    noisy = mech.release_many([int(x) for x in exact], GeneratorSource(rng))
    return np.asarray(noisy, dtype=np.float64), mech.cost()


def dp_mean_variance(values: np.ndarray, lower: float, upper: float, *, epsilon: float,
                     rng: np.random.Generator,
                     min_variance: float = 1e-4) -> tuple[float, float, PrivacyCost]:
    """DP mean and variance of one bounded column (a single-column convenience).

    Returns the mean and variance in the column's own units.

    Privacy
    -------
    Values are clipped to the public ``[lower, upper]`` and scaled to ``v in [-1, 1]``.
    Replace-one row (``N`` public) changes ``(sum v, sum v^2)`` by ``(v - w, v^2 - w^2)``,
    L1 norm ``<= 9/4`` (:data:`MOMENTS_SENSITIVITY`): Laplace scale ``(9/4)/epsilon`` on both
    sums, epsilon-DP.
    """
    if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
        raise ValidationError(f"need finite lower < upper, got [{lower!r}, {upper!r}]")
    col = ContinuousColumn("value", float(lower), float(upper))
    y = np.asarray(values, dtype=np.float64)
    if y.ndim != 1 or y.size == 0 or not np.all(np.isfinite(y)):
        raise ValidationError("values must be a non-empty finite 1-d array")
    v = _scaled(col, np.clip(y, lower, upper))
    mech = LaplaceMechanism(epsilon, MOMENTS_SENSITIVITY)
    noisy = mech.release(np.array([v.sum(), np.dot(v, v)]), rng)
    mean_v, var_v = mean_variance_from_moments(noisy, y.size, min_variance=min_variance,
                                               noise_scale=mech.scale)
    return (col.center + col.half_range * mean_v, col.half_range ** 2 * var_v, mech.cost())
