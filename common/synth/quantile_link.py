"""Quantile link for continuous columns: a DP histogram on public bins -> DP CDF -> Phi^-1.

The identity link of :mod:`dpfed.common.synth.links` standardises a continuous column and
treats it as Gaussian, so a skewed or multi-modal column comes back bell-shaped. The quantile
link keeps the column's shape: with public bin edges ``e_0 = min < e_1 < ... < e_B = max``
(equal-width on the schema bounds, :func:`bin_edges`) and DP proportions ``pi_b`` of the bins
(floored, so the CDF ``F`` at the edges is strictly increasing),

forward
    a value ``y`` in bin ``b`` gets ``u = F(e_b) + U pi_b`` with ``U ~ Uniform(0, 1)`` (a
    randomised probability integral transform: exactly uniform when the DP proportions are
    the data's, even with point masses such as many identical readings), then ``z = Phi^-1(u)``;
inverse
    ``y = F^-1(Phi(z))`` with ``F`` linear inside each bin (values spread uniformly within a
    bin), so every decoded value lies within the schema bounds and a standard normal ``z``
    decodes to exactly the DP histogram.

An ``integer`` column (:class:`~dpfed.common.data.schema.ContinuousColumn`) decodes to whole
numbers bin by bin (:func:`snap_to_whole`): a bin's decoded mass is spread evenly over the
whole numbers inside the bin, so with bins narrower than one the decoded counts are exactly the
DP histogram's.

Every latent coordinate of this link is standard normal under the link model, like the
ordinal and nominal links, so the generative mode's correlation correction and rescaling apply
unchanged. Privacy: the link is post-processing of the DP bin proportions; the bins are public
(schema bounds and a public bin count), never data-derived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import special

from dpfed.common.data.schema import ContinuousColumn
from dpfed.common.errors import ValidationError
from dpfed.common.synth.links import ContinuousLink
from dpfed.common.validation import check_finite_array, check_int

#: Default number of public bins per continuous column.
DEFAULT_BINS = 32
MAX_BINS = 4096
_U_MIN = 2.0 ** -53
_GRID_LO = -8.5
_GRID_POINTS = 16385
_GRID_STEP = 17.0 / (_GRID_POINTS - 1)
#: Integer columns with more whole numbers than this are decoded by plain rounding (their
#: bins hold thousands of whole numbers each, where spreading evenly is rounding).
_MAX_WHOLE_NUMBERS = 1 << 20


def bin_edges(column: ContinuousColumn, n_bins: int) -> np.ndarray:
    """Return the ``n_bins + 1`` public, equal-width bin edges of ``column``'s declared bounds."""
    b = check_int(n_bins, "n_bins", minimum=2, maximum=MAX_BINS)
    return np.linspace(column.min, column.max, b + 1)


def bin_codes(column: ContinuousColumn, values: np.ndarray, n_bins: int) -> np.ndarray:
    """Bin index (0..n_bins-1) of each value; values are clipped to the bounds first."""
    v = np.asarray(values, dtype=np.float64)
    width = (column.max - column.min) / n_bins
    codes = np.floor((np.clip(v, column.min, column.max) - column.min) / width)
    return np.clip(codes, 0, n_bins - 1).astype(np.intp)


@lru_cache(maxsize=256)
def _whole_numbers_per_bin(column: ContinuousColumn, n_bins: int
                           ) -> tuple[np.ndarray, np.ndarray] | None:
    """(first whole number, how many) of each public bin, by :func:`bin_codes`'s own rule."""
    lo, hi = int(column.min), int(column.max)
    if hi - lo + 1 > _MAX_WHOLE_NUMBERS:
        return None
    counts = np.bincount(bin_codes(column, np.arange(lo, hi + 1, dtype=np.float64), n_bins),
                         minlength=n_bins)
    first = lo + np.concatenate([[0], np.cumsum(counts)[:-1]])
    return first.astype(np.float64), counts.astype(np.float64)


def snap_to_whole(column: ContinuousColumn, values: np.ndarray, n_bins: int) -> np.ndarray:
    """Whole numbers for the decoded values of an ``integer`` column (post-processing).

    A value at relative position ``t`` in its public bin becomes the ``floor(t k)``-th of the
    bin's ``k`` whole numbers: values spread uniformly within a bin (as the quantile link and
    the pair correction decode them) fall evenly on the bin's whole numbers, and the bins'
    masses are kept exactly. A bin without a whole number (bins narrower than one) holds only
    noise mass; its values go to the nearest whole number. Returns float64 within the bounds.
    """
    v = np.clip(np.asarray(values, dtype=np.float64), column.min, column.max)
    per_bin = _whole_numbers_per_bin(column, n_bins)
    if per_bin is None:
        return np.rint(v)
    first, counts = per_bin
    width = (column.max - column.min) / n_bins
    codes = bin_codes(column, v, n_bins)
    t = np.clip((v - column.min) / width - codes, 0.0, 1.0 - 1e-12)
    k = counts[codes]
    out = first[codes] + np.floor(t * k)
    empty = k == 0
    out[empty] = np.rint(v[empty])
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True, eq=False)
class QuantileLink(ContinuousLink):
    """Continuous column linked through its DP CDF on public bins (see the module docstring).

    ``mean``/``sd`` of the parent are unused (0, 1); ``standard_normal`` is True.
    """

    proportions: np.ndarray = field(default_factory=lambda: np.zeros(0))
    edges: np.ndarray = field(init=False)
    cdf: np.ndarray = field(init=False)
    _table: np.ndarray = field(init=False, repr=False)
    _slope: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = check_finite_array(self.proportions, f"bin proportions of {self.column.name!r}",
                               ndim=1)
        if p.shape[0] < 2 or np.any(p <= 0) or abs(float(p.sum()) - 1.0) > 1e-9:
            raise ValidationError(
                f"bin proportions of {self.column.name!r} must be >= 2 strictly positive "
                "numbers summing to 1")
        p = p / p.sum()
        cdf = np.concatenate([[0.0], np.cumsum(p)])
        cdf[-1] = 1.0
        object.__setattr__(self, "proportions", p)
        object.__setattr__(self, "edges", bin_edges(self.column, p.shape[0]))
        object.__setattr__(self, "cdf", cdf)
        object.__setattr__(self, "standard_normal", True)
        # Decoding table on a uniform z grid: y = F^-1(Phi(z)) sampled every _GRID_STEP, so
        # decoding is index arithmetic plus one linear interpolation (no ndtr, no search).
        z = _GRID_LO + _GRID_STEP * np.arange(_GRID_POINTS)
        table = np.interp(special.ndtr(z), cdf, self.edges)
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_slope", np.append(np.diff(table), 0.0))

    @property
    def n_bins(self) -> int:
        """Number of public bins."""
        return int(self.proportions.shape[0])

    def forward(self, values: np.ndarray, out: np.ndarray,
                rng: np.random.Generator | None = None) -> None:
        """Randomised PIT through the DP CDF, then ``Phi^-1`` (needs ``rng``)."""
        if rng is None:
            raise ValidationError("the quantile link draws its latent values: pass an rng")
        codes = bin_codes(self.column, values, self.n_bins)
        u = rng.random(codes.shape[0])
        u *= self.proportions[codes]
        u += self.cdf[codes]
        np.clip(u, _U_MIN, 1.0 - _U_MIN, out=u)
        out[:, 0] = special.ndtri(u)

    def inverse(self, latent: np.ndarray) -> np.ndarray:
        """``F^-1(Phi(z))`` (float64); always within the schema bounds.

        Interpolated linearly in z on a grid of step ``_GRID_STEP`` over ``[-8.5, 8.5]``
        (exact at the grid points; between them the error is of order ``step^2`` times the
        curvature, far below one bin width); beyond the grid the bounds.
        """
        # float64 from here whatever the latent's precision (float32 from the sampler).
        t = np.subtract(latent[:, 0], _GRID_LO, dtype=np.float64)
        t *= 1.0 / _GRID_STEP
        np.clip(t, 0.0, _GRID_POINTS - 1.000001, out=t)
        i = t.astype(np.intp)
        t -= i
        y = self._table.take(i)
        t *= self._slope.take(i)
        y += t
        if self.column.integer:
            return snap_to_whole(self.column, y, self.n_bins)
        return np.asarray(y)

    def moments(self) -> tuple[float, float]:
        """Mean and variance of the decoded column (piecewise-uniform density)."""
        lo, hi = self.edges[:-1], self.edges[1:]
        mid = 0.5 * (lo + hi)
        mean = float(self.proportions @ mid)
        second = float(self.proportions @ (mid * mid + (hi - lo) ** 2 / 12.0))
        return mean, max(second - mean * mean, 0.0)


def identity_link_from_bins(column: ContinuousColumn, proportions: np.ndarray,
                            min_variance: float = 1e-4) -> ContinuousLink:
    """Return the identity link with mean/sd taken from DP bin proportions (post-processing).

    The piecewise-uniform density of the bins gives the mean and variance of ``y``; they are
    turned into the scaled ``v = (y - centre) / half_range`` units of :class:`ContinuousLink`.
    """
    q = QuantileLink(column, proportions=np.asarray(proportions, dtype=np.float64))
    mean_y, var_y = q.moments()
    h = column.half_range
    mean_v = (mean_y - column.center) / h
    sd_v = float(np.sqrt(max(var_y / (h * h), min_variance)))
    return ContinuousLink(column, mean_v, sd_v, True)
