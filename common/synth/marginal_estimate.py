"""A continuous column's distribution from its noisy release: tails, point masses, fine shape.

Post-processing of the link round's release (:mod:`dpfed.common.synth.column_cells`): the
noisy counts of the column's coarse cells and, for columns with leaves, of its leaves, with
the public standard deviation of their noise. The estimate places the public row count ``N``
top-down on a binary tree over the cells in value order (:func:`allocate`):

* every node splits its mass between its two halves in proportion to their noisy sums --
  unless a half's sum is not significantly above 0 (at most ``tau`` standard deviations of
  its noise): that half gets nothing, and if neither half is, the mass is spread by the
  cells' public widths. A tail or gap the noise only pretends to fill stays empty (an
  estimate that just clips noisy counts at 0, or projects them onto the simplex, keeps
  about half a noise standard deviation in every empty cell, which a long range of empty
  cells turns into a fat tail), while a tail whose mass is spread thin over many cells is
  still found where the sums of whole subtrees are significant;
* inside a bin (its leaves, :func:`fine_shape`), a split also keeps the bin's even shape
  unless the two halves differ by more than ``shape_tau`` standard deviations of the noisy
  fraction: a value many rows share (a point mass) or a bulk squeezed into a corner of a
  wide bin is resolved to its leaf, and a smooth bin is not made rough by the leaves' noise.

Privacy: post-processing of DP counts and of public values (``N``, the noise levels, the
cells); nothing here reads a row.
"""

from __future__ import annotations

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.synth.column_cells import ColumnCells

#: Between coarse cells, every half's noisy sum is shrunk by this many standard deviations of
#: its noise (soft thresholding) before the split.
SPARSITY_TAU = 0.75
#: A half whose noisy sum is at most this many standard deviations of its noise gets nothing
#: (before the soft threshold): a range of empty cells keeps no noise.
FLOOR_TAU = 2.0
#: A single cell whose noisy count exceeds this many noise standard deviations keeps its
#: subtree's share at least at its count less that many deviations (an isolated point mass,
#: a ceiling, is not dissolved in the noise of the empty cells around it).
SPIKE_TAU = 2.5
#: Inside a bin, a split departs from the even shape only beyond this many standard
#: deviations of the noisy fraction.
SHAPE_TAU = 2.5


def _pad(a: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(a.shape[:-1] + (size,))
    out[..., :a.shape[-1]] = a
    return out


def allocate(total: np.ndarray, noisy: np.ndarray, variance: np.ndarray, prior: np.ndarray,
             *, shape: bool = False) -> np.ndarray:
    """Place ``total[i]`` over row ``i``'s cells top-down (module docstring); shape (k, n).

    ``noisy``, ``variance`` and ``prior`` have shape (k, n) (one row per independent
    problem, cells in value order); cells beyond a row's end have prior 0 and variance 0
    (padding). Without ``shape`` a node splits in proportion to its halves' noisy sums, each
    soft-thresholded at :data:`SPARSITY_TAU` standard deviations of its noise (a half no
    larger than its noise gets nothing; if neither half is, the split follows the prior).
    With ``shape`` the node's mass ``m`` is taken as known: both halves' noisy sums estimate
    the left half's share (inverse-variance weighted), which replaces the prior's share only
    when they differ by more than :data:`SHAPE_TAU` standard deviations. Returns non-negative
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
    # A single cell far above its noise is mass, however much noise its subtree adds.
    spike = np.clip(yp - SPIKE_TAU * np.sqrt(vp), 0.0, None)
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
        if shape:
            f = _shape_split(mass, ys, vs, even)
        else:
            sd = np.sqrt(vs)
            soft = np.where(ys > FLOOR_TAU * sd, np.clip(ys - SPARSITY_TAU * sd, 0.0, None), 0.0)
            kept = np.maximum(soft, ss) * (rs > 0)
            both = kept.sum(axis=2)
            f = np.divide(kept[..., 0], both, out=even.copy(), where=both > 0)
        mass = np.stack([mass * f, mass * (1.0 - f)], axis=2).reshape(k, -1)
    return np.asarray(mass[:, :n])


def _shape_split(mass: np.ndarray, ys: np.ndarray, vs: np.ndarray,
                 even: np.ndarray) -> np.ndarray:
    """Left share of every node with known ``mass``: the prior's unless the data differ."""
    vl, vr = vs[..., 0], vs[..., 1]
    precision = np.divide(1.0, vl, out=np.zeros_like(vl), where=vl > 0) + np.divide(
        1.0, vr, out=np.zeros_like(vr), where=vr > 0)
    safe = np.where(mass > 0, mass, 1.0)
    left = ys[..., 0] / safe      # estimates the share with variance vl / m^2
    right = 1.0 - ys[..., 1] / safe   # ... and with variance vr / m^2
    weighted = (np.divide(left, vl, out=np.zeros_like(vl), where=vl > 0)
                + np.divide(right, vr, out=np.zeros_like(vr), where=vr > 0))
    share = np.divide(weighted, precision, out=even.copy(), where=precision > 0)
    sd = np.divide(1.0, np.sqrt(precision) * safe, out=np.full_like(even, np.inf),
                   where=precision > 0)
    return np.where((np.abs(share - even) > SHAPE_TAU * sd) & (mass > 0),
                    np.clip(share, 0.0, 1.0), even)


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


def fine_shape(cells: ColumnCells, bin_mass: np.ndarray, noisy: np.ndarray,
               variance: np.ndarray) -> np.ndarray:
    """Leaf masses inside every bin of a column with leaves, given each bin's mass.

    ``bin_mass`` has one entry per bin (coarse cells ``1..n_bins``); ``noisy`` and
    ``variance`` one per leaf inside the bins (:attr:`ColumnCells.fine_leaves`). The even
    shape a split is shrunk to is :func:`interpolated_prior`'s. Returns the masses of those
    leaves.
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
    out = allocate(bin_mass, y, v, p, shape=True)
    return np.asarray(out[inner, col])


def column_masses(cells: ColumnCells, block: np.ndarray, sd: np.ndarray,
                  n_rows: float) -> np.ndarray:
    """Leaf masses (summing to ``n_rows``) of one continuous column from its release block.

    ``block`` is the column's noisy release (coarse cells, then fine leaves) and ``sd`` the
    public noise standard deviation of each of its cells.
    """
    y = np.asarray(block, dtype=np.float64)
    s = np.asarray(sd, dtype=np.float64)
    if y.shape != (cells.release_size,) or s.shape != y.shape:
        raise ValidationError(f"column {cells.column.name!r}: release block of "
                              f"{cells.release_size} cells expected, got {y.shape}")
    c = cells.n_coarse
    coarse_prior = np.bincount(cells.coarse, weights=cells.prior, minlength=c)
    coarse = allocate(np.array([float(n_rows)]), y[:c], s[:c] ** 2, coarse_prior)[0]
    if not cells.has_fine:
        return np.asarray(coarse)
    out = np.zeros(cells.n_leaves)
    out[0], out[-1] = coarse[0], coarse[-1]
    out[cells.fine_leaves] = fine_shape(cells, coarse[1:-1], y[c:], s[c:] ** 2)
    return out
