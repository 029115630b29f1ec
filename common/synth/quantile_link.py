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

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import special

from dpfed.common.data.schema import ContinuousColumn
from dpfed.common.errors import ValidationError
from dpfed.common.synth.column_cells import ColumnCells, column_cells
from dpfed.common.synth.links import ContinuousLink
from dpfed.common.validation import check_finite_array, check_int

#: Default number of public bins per continuous column.
DEFAULT_BINS = 32
MAX_BINS = 4096
_U_MIN = 2.0 ** -53
_GRID_LO = -8.5
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


#: A leaf of a non-integer column whose density is this many times both neighbours' is a
#: point mass (values heaped on one number) and decodes to one value (:func:`point_values`).
SPIKE_RATIO = 3.0
#: The steps a point mass is placed on, roundest first (times powers of ten).
_NICE = (5.0, 2.0, 1.0)


def roundest(lo: float, hi: float) -> float:
    """Return the roundest number in ``[lo, hi)``: a multiple of the largest nice step in it.

    Steps are ``{5, 2, 1} x 10^k`` from the range's magnitude down; for any interval of
    positive width one is found (steps smaller than the width always are).
    """
    if not hi > lo:
        return lo
    top = math.floor(math.log10(max(abs(lo), abs(hi), hi - lo)))
    for k in range(top + 1, top - 20, -1):
        for f in _NICE:
            d = f * 10.0 ** k
            m = math.ceil(lo / d) * d
            if lo <= m < hi:
                return float(m)
    return lo


def point_values(cells: ColumnCells, proportions: np.ndarray) -> np.ndarray:
    """Per leaf the value its mass decodes to when it is a point mass, else NaN.

    Real columns heap on round numbers (incomes of 2 000, readings of 4.5): the "fine"
    estimate puts such a pile into one leaf whose density stands far above its neighbours'
    (:data:`SPIKE_RATIO`), and decoding it to the roundest number in the leaf
    (:func:`roundest`) puts the synthetic rows where the real ones are, instead of spreading
    them across the leaf. Non-integer interval leaves of the "fine" layout only (integer
    columns already decode to whole numbers). A function of the public cells and the DP
    proportions: post-processing.
    """
    out = np.full(cells.n_leaves, np.nan)
    if cells.kind != "fine" or cells.column.integer:
        return out
    p = np.asarray(proportions, dtype=np.float64)
    width = cells.hi - cells.lo
    interval = width > 0
    density = np.divide(p, width, out=np.zeros_like(p), where=interval)
    left = np.concatenate([[np.inf], density[:-1]])
    right = np.concatenate([density[1:], [np.inf]])
    left[1:][~interval[:-1]] = 0.0   # a bound's point cell is no neighbour to compare with
    right[:-1][~interval[1:]] = 0.0
    spike = interval & (density > SPIKE_RATIO * np.maximum(left, right)) & (
        p > 1.0 / cells.n_leaves)
    for k in np.flatnonzero(spike):
        out[k] = roundest(float(cells.lo[k]), float(cells.hi[k]))
    return out


#: Decoding grid: ``z`` in [-8.5, 8.5] in steps of 17 / (points - 1).
_DECODE_POINTS = 16385
_DECODE_STEP = 17.0 / (_DECODE_POINTS - 1)


@dataclass(frozen=True, eq=False)
class _Decoder:
    """Tables that turn a latent ``z`` into a value in O(1) per value (see ``inverse``)."""

    value: np.ndarray   # F^-1(Phi(z_i)) on the grid
    slope: np.ndarray   # value[i + 1] - value[i]
    exact: np.ndarray   # grid intervals where linear interpolation is not exact (bool)


@dataclass(frozen=True, eq=False)
class QuantileLink(ContinuousLink):
    """Continuous column linked through its DP CDF on public cells (module docstring).

    ``cells`` are the column's cells (:func:`dpfed.common.synth.column_cells.column_cells`;
    None: ``len(proportions)`` equal-width bins, the "bins" layout) and ``proportions`` one
    DP proportion per cell (leaf). ``mean``/``sd`` of the parent are unused (0, 1);
    ``standard_normal`` is True.
    """

    proportions: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cells: ColumnCells | None = None
    edges: np.ndarray = field(init=False)
    cdf: np.ndarray = field(init=False)
    points: np.ndarray = field(init=False, repr=False)
    _decoder: list[_Decoder] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = check_finite_array(self.proportions, f"bin proportions of {self.column.name!r}",
                               ndim=1)
        if p.shape[0] < 2 or np.any(p <= 0) or abs(float(p.sum()) - 1.0) > 1e-9:
            raise ValidationError(
                f"bin proportions of {self.column.name!r} must be >= 2 strictly positive "
                "numbers summing to 1")
        cells = self.cells
        if cells is None:
            cells = column_cells(self.column, p.shape[0], 1, "bins")
        if cells.column != self.column or cells.n_leaves != p.shape[0]:
            raise ValidationError(f"{p.shape[0]} proportions for the {cells.n_leaves} cells of "
                                  f"{self.column.name!r}")
        p = p / p.sum()
        cdf = np.concatenate([[0.0], np.cumsum(p)])
        cdf[-1] = 1.0
        object.__setattr__(self, "proportions", p)
        object.__setattr__(self, "cells", cells)
        object.__setattr__(self, "edges", np.concatenate([cells.lo, cells.hi[-1:]]))
        object.__setattr__(self, "cdf", cdf)
        object.__setattr__(self, "points", point_values(cells, p))
        object.__setattr__(self, "standard_normal", True)
        object.__setattr__(self, "_decoder", [])

    @property
    def n_bins(self) -> int:
        """Number of cells (leaves)."""
        return int(self.proportions.shape[0])

    @property
    def layout(self) -> ColumnCells:
        """The column's cells."""
        assert self.cells is not None
        return self.cells

    def forward(self, values: np.ndarray, out: np.ndarray,
                rng: np.random.Generator | None = None) -> None:
        """Randomised PIT through the DP CDF, then ``Phi^-1`` (needs ``rng``)."""
        if rng is None:
            raise ValidationError("the quantile link draws its latent values: pass an rng")
        codes = self.layout.codes(values)
        u = rng.random(codes.shape[0])
        u *= self.proportions[codes]
        u += self.cdf[codes]
        np.clip(u, _U_MIN, 1.0 - _U_MIN, out=u)
        out[:, 0] = special.ndtri(u)

    def _tables(self) -> _Decoder:
        """Build (once) the decoding tables: ``F^-1(Phi(z))`` on a fine ``z`` grid.

        A grid interval is decoded by linear interpolation when ``F^-1`` is linear in
        probability across it (inside one interval cell, or across cells of equal density);
        an interval inside one point cell decodes to its value; intervals that cross into or out
        of a point cell or a change of density, or touch an integer column's multi-number cell,
        are marked ``exact`` and decoded through the cells.
        """
        if self._decoder:
            return self._decoder[0]
        cells = self.layout
        z = _GRID_LO + _DECODE_STEP * np.arange(_DECODE_POINTS)
        u = special.ndtr(z)
        leaf = np.clip(np.searchsorted(self.cdf, u, side="right") - 1, 0, self.n_bins - 1)
        pos = (u - self.cdf[leaf]) / self.proportions[leaf]
        value = self._values(leaf, pos)
        # Cells whose decoded values are a straight line in probability with their neighbour:
        # interval cells (lo < hi) of equal density; anything else breaks the line.
        spike = ~np.isnan(self.points)
        # A missing cell decodes to NaN everywhere inside it: a point cell's run of its own.
        absent = np.zeros(self.n_bins, dtype=bool)
        absent[cells.n_value_leaves:] = True
        width = np.where(spike | absent, 0.0, cells.hi - cells.lo)
        density = np.divide(width, self.proportions)
        point = width <= 0.0
        # Integer columns: every cell decodes on its own (a whole number, or several spread
        # evenly: those through the cells).
        whole = cells.column.integer & (cells.count != 1) & ~absent
        smooth = ~point & (not cells.column.integer)
        same = np.zeros(self.n_bins, dtype=bool)  # cell k continues cell k - 1's line
        same[1:] = (smooth[1:] & smooth[:-1]
                    & np.isclose(density[1:], density[:-1], rtol=1e-9, atol=0.0)
                    & np.isclose(cells.lo[1:], cells.hi[:-1], rtol=0.0, atol=1e-12))
        run = np.cumsum(~same)  # cells of one straight run share a run id (a point cell: its own)
        exact = (run[leaf[1:]] != run[leaf[:-1]]) | whole[leaf[:-1]] | whole[leaf[1:]]
        exact = np.append(exact, True)
        slope = np.append(np.diff(value), 0.0)
        dec = _Decoder(np.asarray(value, dtype=np.float64), slope, exact)
        self._decoder.append(dec)
        return dec

    def inverse(self, latent: np.ndarray) -> np.ndarray:
        """``F^-1(Phi(z))`` (float64); always within the schema bounds.

        One table lookup and one linear interpolation in z per value where that is exact up
        to the grid's rounding (inside a run of equal-density interval cells; the grid's step
        is far below one cell's probability); the few values in intervals that straddle a
        point cell, a change of density, or fall in an integer column's multi-number cell are
        decoded exactly through the cells (``Phi``, the cell, the position in it). Point cells
        decode to their value exactly; integer columns to whole numbers.
        """
        dec = self._tables()
        # float64 from here whatever the latent's precision (float32 from the sampler).
        t = np.subtract(latent[:, 0], _GRID_LO, dtype=np.float64)
        t *= 1.0 / _DECODE_STEP
        np.clip(t, 0.0, _DECODE_POINTS - 1.000001, out=t)
        i = t.astype(np.intp)
        t -= i
        y = dec.value.take(i)
        t *= dec.slope.take(i)
        y += t
        slow = np.flatnonzero(dec.exact.take(i))
        if slow.size:
            y[slow] = self._exact(np.asarray(latent[slow, 0], dtype=np.float64))
        return np.asarray(y)

    def _exact(self, z: np.ndarray) -> np.ndarray:
        """Decode through the cells: ``u = Phi(z)``, its cell, its position in the cell."""
        u = special.ndtr(np.clip(z, _GRID_LO, -_GRID_LO))
        leaf = np.clip(np.searchsorted(self.cdf, u, side="right") - 1, 0, self.n_bins - 1)
        pos = (u - self.cdf[leaf]) / self.proportions[leaf]
        return self._values(leaf, pos)

    def _values(self, leaf: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Return the cells' values (:meth:`ColumnCells.values`), point masses at their point."""
        out = self.layout.values(leaf, pos)
        point = self.points[leaf]
        spike = ~np.isnan(point)
        out[spike] = point[spike]
        return out

    def leaves(self, latent: np.ndarray) -> np.ndarray:
        """Return the cell (leaf) every latent value decodes into (as :meth:`inverse` does)."""
        u = special.ndtr(np.asarray(latent[:, 0], dtype=np.float64))
        return np.asarray(np.clip(np.searchsorted(self.cdf, u, side="right") - 1, 0,
                                  self.n_bins - 1))

    def moments(self) -> tuple[float, float]:
        """Mean and variance of the decoded column (piecewise-uniform density on the cells).

        Of its values: a missing cell's mass is left out.
        """
        k = self.layout.n_value_leaves
        lo, hi = self.layout.lo[:k], self.layout.hi[:k]
        p = self.proportions[:k]
        if self.layout.has_missing:
            p = p / p.sum()
        mid = 0.5 * (lo + hi)
        mean = float(p @ mid)
        second = float(p @ (mid * mid + (hi - lo) ** 2 / 12.0))
        return mean, max(second - mean * mean, 0.0)


def identity_link_from_bins(column: ContinuousColumn, proportions: np.ndarray,
                            quantile: QuantileLink | None = None,
                            min_variance: float = 1e-4) -> ContinuousLink:
    """Return the identity link with mean/sd taken from DP cell proportions (post-processing).

    The piecewise-uniform density of the cells (``quantile``'s, else ``len(proportions)``
    equal-width bins) gives the mean and variance of ``y``; they are turned into the scaled
    ``v = (y - centre) / half_range`` units of :class:`ContinuousLink`.
    """
    q = quantile if quantile is not None else QuantileLink(
        column, proportions=np.asarray(proportions, dtype=np.float64))
    mean_y, var_y = q.moments()
    h = column.half_range
    mean_v = (mean_y - column.center) / h
    sd_v = float(np.sqrt(max(var_y / (h * h), min_variance)))
    return ContinuousLink(column, mean_v, sd_v, True)
