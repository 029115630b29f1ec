"""A continuous column's distribution from its noisy release: tails, point masses, fine shape.

Post-processing of the link round's release (:mod:`dpfed.common.synth.column_cells`): the
noisy counts of the column's coarse cells and, for columns with leaves, of its leaves, with
the public standard deviation of their noise. The estimate places the public row count ``N``
top-down on a binary tree over the cells in value order (:func:`allocate`):

* a node's halves share its mass as the cells' public widths say (the prior) unless their
  noisy sums differ from that by more than ``SHAPE_TAU`` standard deviations, then as the
  sums say (:func:`_shape_split`). A flat stretch whose cells are about as noisy as they
  are full stays flat instead of collecting its rows on noise peaks;
* between coarse cells, one half gets all of the node's mass where the data say the other
  half is empty (:func:`_sparse_split`): "all in one half" fits the halves' noisy sums about
  as well as their best split, the other half's sum is small against its noise (or the
  even split fits worse), the node's mass stands well above that noise, and the other
  half holds no single cell far above its noise (a ceiling, a point mass). A tail or gap
  the noise only pretends to fill stays empty -- an estimate that clips noisy counts at 0
  keeps about half a noise standard deviation in every empty cell, which a long range of
  empty cells turns into a fat tail -- while a tail spread thin over many cells is still
  found where whole subtrees' sums are significant;
* inside a bin (its leaves, :func:`fine_shape`) the prior is a density interpolated
  between the bins (:func:`interpolated_prior`), and only the first rule applies: a value
  many rows share (a point mass) or a bulk squeezed into a corner of a wide bin is
  resolved to its leaf, and a smooth bin is not made rough by the leaves' noise;
* with ``heaps`` (new jobs), a leaf far above its own noise (:func:`spike_tau` of the
  column's leaves) is a heap -- many rows on one reading -- and keeps its noisy count
  before the rest of the bin is split (:func:`heap_masses`): top-down, a heap only wins
  the splits whose halves' summed noise it stands out of, so a heap in a wide bin kept a
  fraction of its rows.

The constants were set on the tuning tables of ``bench/real_tables.py`` and the demo data
(docs/benchmarks.md).

Privacy: post-processing of DP counts and of public values (``N``, the noise levels, the
cells); nothing here reads a row.
"""

from __future__ import annotations

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.synth.column_cells import ColumnCells

#: "One half holds all the node's rows" must fit the halves' noisy sums within this many
#: log-likelihood units of their best split ...
SPARSE_SLACK = 3.0
#: ... and, unless the other half's noisy sum is at most EMPTY_TAU of its noise standard
#: deviations, fit them better than the even split by SPARSE_GAIN units ...
SPARSE_GAIN = 0.5
EMPTY_TAU = 1.5
#: ... and the node's mass must be at least this many of the other half's noise standard
#: deviations (below that, noise would pick the half).
SPARSE_SNR = 5.0
#: A single cell above this many noise standard deviations (more for long rows of cells,
#: :func:`spike_tau`) keeps its half from being emptied: an isolated point mass, a ceiling.
SPIKE_TAU = 2.5
#: Inside a bin, a split departs from the even shape only beyond this many standard
#: deviations of the noisy fraction.
SHAPE_TAU = 2.5


def spike_tau(n_cells: int) -> float:
    """Noise standard deviations a single cell of ``n_cells`` must exceed to be a spike.

    The largest of ``n`` independent standard normals is about ``sqrt(2 ln n)``; a spike is
    one more deviation above that (at least :data:`SPIKE_TAU`), which pure noise reaches in
    well under 1 % of rows of cells.
    """
    return max(SPIKE_TAU, float(np.sqrt(2.0 * np.log(max(n_cells, 1)))) + 1.0)


def _pad(a: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(a.shape[:-1] + (size,))
    out[..., :a.shape[-1]] = a
    return out


def allocate(total: np.ndarray, noisy: np.ndarray, variance: np.ndarray, prior: np.ndarray,
             *, shape: bool = False) -> np.ndarray:
    """Place ``total[i]`` over row ``i``'s cells top-down (module docstring); shape (k, n).

    ``noisy``, ``variance`` and ``prior`` have shape (k, n) (one row per independent
    problem, cells in value order); cells beyond a row's end have prior 0 and variance 0
    (padding). Every node's mass ``m`` is known from its parent; its split follows the
    prior unless the halves' noisy sums say otherwise (:func:`_shape_split`), and without
    ``shape`` one half may get it all (:func:`_sparse_split`). Returns non-negative
    masses, each row summing to its ``total``.
    """
    y = np.atleast_2d(np.asarray(noisy, dtype=np.float64))
    v = np.atleast_2d(np.asarray(variance, dtype=np.float64))
    p = np.atleast_2d(np.asarray(prior, dtype=np.float64))
    if y.shape != v.shape or y.shape != p.shape:
        raise ValidationError(f"noisy, variance and prior must have one shape, got {y.shape}, "
                              f"{v.shape}, {p.shape}")
    k, n = y.shape
    m = np.asarray(total, dtype=np.float64).reshape(k)
    size = 1
    while size < n:
        size *= 2
    real = _pad(np.ones((k, n)), size)
    yp, vp = _pad(y, size), _pad(v, size)
    # A single cell far above its noise is mass, however much noise its subtree adds; "far"
    # grows with the number of cells, so that pure noise is not a spike anywhere in the row.
    spike = np.clip(yp - spike_tau(n) * np.sqrt(vp), 0.0, None)
    levels = [(yp, vp, _pad(p, size), real, spike)]
    while levels[-1][0].shape[1] > 1:
        y_, v_, p_, r_, s_ = (a.reshape(k, -1, 2) for a in levels[-1])
        levels.append((y_.sum(axis=2), v_.sum(axis=2), p_.sum(axis=2), r_.sum(axis=2),
                       s_.max(axis=2)))
    mass = m.reshape(k, 1)
    for yl, vl, pl, rl, sl in reversed(levels[:-1]):
        ys, vs, ps, rs, ss = (a.reshape(k, -1, 2) for a in (yl, vl, pl, rl, sl))
        width = ps.sum(axis=2)
        count = rs.sum(axis=2)
        even = np.divide(ps[..., 0], width, out=np.divide(
            rs[..., 0], count, out=np.full_like(width, 0.5), where=count > 0),
            where=width > 0)
        f, free = _shape_split(mass, ys, vs, even)
        if not shape:
            f = _sparse_split(mass, ys, vs, even, free, ss, f)
        # Padding beyond a row's cells gets nothing.
        f = np.where(rs[..., 1] == 0, 1.0, np.where(rs[..., 0] == 0, 0.0, f))
        mass = np.stack([mass * f, mass * (1.0 - f)], axis=2).reshape(k, -1)
    return np.asarray(mass[:, :n])


def _shape_split(mass: np.ndarray, ys: np.ndarray, vs: np.ndarray,
                 even: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Left share of every node with known ``mass``: the prior's unless the data differ.

    Returns (that share, the data's own estimate of it clipped to [0, 1]).
    """
    vl, vr = vs[..., 0], vs[..., 1]
    precision = np.divide(1.0, vl, out=np.zeros_like(vl), where=vl > 0) + np.divide(
        1.0, vr, out=np.zeros_like(vr), where=vr > 0)
    safe = np.where(mass > 0, mass, 1.0)
    left = ys[..., 0] / safe      # estimates the share with variance vl / m^2
    right = 1.0 - ys[..., 1] / safe   # ... and with variance vr / m^2
    weighted = (np.divide(left, vl, out=np.zeros_like(vl), where=vl > 0)
                + np.divide(right, vr, out=np.zeros_like(vr), where=vr > 0))
    share = np.divide(weighted, precision, out=even.copy(), where=precision > 0)
    # The share's departure from the prior in standard deviations (0 where nothing is known).
    z = np.abs(share - even) * np.sqrt(precision) * safe
    free = np.clip(share, 0.0, 1.0)
    return np.where((z > SHAPE_TAU) & (precision > 0) & (mass > 0), free, even), free


def _sparse_split(mass: np.ndarray, ys: np.ndarray, vs: np.ndarray, even: np.ndarray,
                  free: np.ndarray, spikes: np.ndarray, shaped: np.ndarray) -> np.ndarray:
    """Give a node's rows all to one half where the data say the other half is empty.

    The Gaussian log-likelihoods of the halves' noisy sums, with the node's ``mass`` known,
    under "one half holds it all" are compared with those of the data's own split
    (``free``) and of the even split: one half gets everything when that fits the sums within
    :data:`SPARSE_SLACK` of the best split and better than the even split by
    :data:`SPARSE_GAIN` -- the edge of a tail, a gap -- and never when the other half holds
    a single cell far above its noise (``spikes``). Elsewhere the node keeps ``shaped``. In a
    flat stretch whose cells are as noisy as they are full, an even split fits the sums better
    than "all in one half", so no noise peak collects the rows.
    """
    yl, yr = ys[..., 0], ys[..., 1]
    vl, vr = vs[..., 0], vs[..., 1]

    def loglik(f: np.ndarray | float) -> np.ndarray:
        a = np.divide((yl - f * mass) ** 2, vl, out=np.zeros_like(yl), where=vl > 0)
        b = np.divide((yr - (1.0 - f) * mass) ** 2, vr, out=np.zeros_like(yr), where=vr > 0)
        return np.asarray(-0.5 * (a + b))

    best = loglik(free)
    flat = loglik(even)
    all_left, all_right = loglik(1.0), loglik(0.0)
    sd = np.sqrt(vs)
    quiet = ys <= EMPTY_TAU * sd
    # Only a node whose mass stands well above the other half's noise can tell an empty
    # half from a full one; below that, noise would pick the half.
    clear = mass[..., None] >= SPARSE_SNR * sd
    left_ok = clear[..., 1] & (spikes[..., 1] <= 0) & (all_left >= best - SPARSE_SLACK) & (
        quiet[..., 1] | (all_left >= flat + SPARSE_GAIN))
    right_ok = clear[..., 0] & (spikes[..., 0] <= 0) & (all_right >= best - SPARSE_SLACK) & (
        quiet[..., 0] | (all_right >= flat + SPARSE_GAIN))
    out = np.where(left_ok & (~right_ok | (all_left >= all_right)), 1.0, shaped)
    out = np.where(right_ok & (~left_ok | (all_right > all_left)), 0.0, out)
    return np.asarray(np.where(mass > 0, out, shaped))


def interpolated_prior(cells: ColumnCells, bin_mass: np.ndarray) -> np.ndarray:
    """Every inner leaf's share of its bin under a density interpolated between bins.

    The bins' densities (mass over width) are placed at the bins' centres and interpolated
    linearly (held flat beyond the first and last centre); a leaf's share is that density at
    its centre times its width (an integer column's leaf: times its whole numbers). A smooth
    column then keeps its slope inside a bin instead of a staircase; the leaves' own counts
    override it only where they differ significantly (:func:`fine_shape`). Returns one prior
    weight per inner leaf (:attr:`ColumnCells.fine_leaves`).
    """
    col = cells.column
    width = (col.max - col.min) / cells.n_bins
    centres = col.min + width * (np.arange(cells.n_bins) + 0.5)
    density = np.clip(np.asarray(bin_mass, dtype=np.float64), 0.0, None) / width
    inner = cells.fine_leaves
    mid = 0.5 * (cells.lo[inner] + cells.hi[inner])
    base = cells.prior[inner]
    shaped = np.interp(mid, centres, density) * base
    bins = cells.coarse[inner] - 1
    total = np.bincount(bins, weights=shaped, minlength=cells.n_bins)
    # A bin whose interpolated density vanishes on every leaf keeps the plain widths.
    return np.asarray(np.where(total[bins] > 0, shaped, base))


def heap_masses(bin_mass: np.ndarray, noisy: np.ndarray, variance: np.ndarray,
                n_leaves: int) -> np.ndarray:
    """Rows of the heaps of every bin (one row per bin, its leaves), 0 for other leaves.

    A leaf whose noisy count is above :func:`spike_tau` of the column's ``n_leaves`` noise
    standard deviations (pure noise reaches that in well under 1 % of columns) keeps its
    noisy count; a bin whose heaps add up to more than its mass has them scaled down to it.
    Post-processing of the noisy counts and their public noise.
    """
    y = np.asarray(noisy, dtype=np.float64)
    v = np.asarray(variance, dtype=np.float64)
    mass = np.clip(np.asarray(bin_mass, dtype=np.float64), 0.0, None)
    heap = (v > 0) & (y > spike_tau(n_leaves) * np.sqrt(v))
    kept = np.where(heap, y, 0.0)
    total = kept.sum(axis=1)
    scale = np.divide(mass, total, out=np.ones_like(total), where=total > mass)
    return np.asarray(kept * scale[:, None])


def fine_shape(cells: ColumnCells, bin_mass: np.ndarray, noisy: np.ndarray,
               variance: np.ndarray, *, heaps: bool = False) -> np.ndarray:
    """Leaf masses inside every bin of a column with leaves, given each bin's mass.

    ``bin_mass`` has one entry per bin (coarse cells ``1..n_bins``); ``noisy`` and
    ``variance`` one per leaf inside the bins (:attr:`ColumnCells.fine_leaves`). The even
    shape a split is shrunk to is :func:`interpolated_prior`'s. With ``heaps`` the bins'
    heaps (:func:`heap_masses`) are placed first and the rest of each bin is split over its
    other leaves. Returns the masses of those leaves.
    """
    inner = cells.coarse[cells.fine_leaves] - 1
    counts = np.bincount(inner, minlength=cells.n_bins)
    width = int(counts.max())
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    col = np.arange(inner.shape[0]) - starts[inner]
    grid = np.zeros((cells.n_bins, width))
    y, v, p = grid.copy(), grid.copy(), grid.copy()
    y[inner, col] = noisy
    v[inner, col] = variance
    p[inner, col] = interpolated_prior(cells, bin_mass)
    if not heaps:
        return np.asarray(allocate(bin_mass, y, v, p, shape=True)[inner, col])
    kept = heap_masses(bin_mass, y, v, inner.shape[0])
    heap = kept > 0
    # Heaps scaled to their bin's mass may leave it a rounding error below 0.
    rest = np.clip(np.clip(np.asarray(bin_mass, dtype=np.float64), 0.0, None)
                   - kept.sum(axis=1), 0.0, None)
    out = allocate(rest, np.where(heap, 0.0, y), v, np.where(heap, 0.0, p), shape=True)
    return np.asarray((out + kept)[inner, col])


#: A missing cell's noisy count must exceed this many of its noise standard deviations to be
#: kept (below, the column is estimated complete): as the tree's empty halves, noise alone
#: does not invent missing values.
MISSING_TAU = 2.0


def missing_mass(count: float, sd: float, n_rows: float) -> float:
    """Rows of the missing cell from its noisy ``count`` (noise ``sd``): 0 unless significant.

    A count below :data:`MISSING_TAU` standard deviations is read as 0; otherwise it is kept,
    at most ``n_rows``. Post-processing.
    """
    if not count > MISSING_TAU * sd:
        return 0.0
    return float(min(count, n_rows))


def column_masses(cells: ColumnCells, block: np.ndarray, sd: np.ndarray,
                  n_rows: float, *, heaps: bool = False) -> np.ndarray:
    """Leaf masses (summing to ``n_rows``) of one continuous column from its release block.

    ``block`` is the column's noisy release (coarse cells, then fine leaves) and ``sd`` the
    public noise standard deviation of each of its cells. A missing cell (last coarse cell
    and leaf) is estimated on its own (:func:`missing_mass`); the rest of ``n_rows`` is placed
    on the value cells. ``heaps``: see :func:`fine_shape`.
    """
    y = np.asarray(block, dtype=np.float64)
    s = np.asarray(sd, dtype=np.float64)
    if y.shape != (cells.release_size,) or s.shape != y.shape:
        raise ValidationError(f"column {cells.column.name!r}: release block of "
                              f"{cells.release_size} cells expected, got {y.shape}")
    c = cells.n_value_coarse
    absent = missing_mass(float(y[c]), float(s[c]), n_rows) if cells.has_missing else 0.0
    coarse_prior = np.bincount(cells.coarse, weights=cells.prior, minlength=cells.n_coarse)[:c]
    coarse = allocate(np.array([float(n_rows) - absent]), y[:c], s[:c] ** 2, coarse_prior)[0]
    out = np.zeros(cells.n_leaves)
    if cells.has_missing:
        out[-1] = absent
    if not cells.has_fine:
        out[:c] = coarse
        return out
    first, last = 0, cells.n_value_leaves - 1
    out[first], out[last] = coarse[0], coarse[c - 1]
    start = cells.n_coarse
    out[cells.fine_leaves] = fine_shape(cells, coarse[1:c - 1], y[start:], s[start:] ** 2,
                                         heaps=heaps)
    return out
