"""The public cells of a continuous column: what its 1-way release counts and its link decodes.

Every cell is a function of the schema (bounds, ``integer``), the job's ``n_bins`` and the
number of continuous columns -- never of the data. Two layouts (the job's ``resolution``):

``bins`` (jobs made before ``resolution`` existed, and their model files)
    ``n_bins`` equal-width bins of the schema bounds, one level; values spread uniformly
    within a bin (whole numbers spread evenly over the bin's whole numbers).
``fine`` (the default)
    * an ``integer`` column with at most :data:`WHOLE_NUMBER_CELLS` (or ``2 n_bins``) whole
      numbers: one cell per whole number (counts, ages in years, scores) -- its point masses
      are its cells;
    * any other continuous column: *coarse cells* -- the two bounds as point cells (the
      floors, ceilings and zeros data pile up on, and where clipped values land) and
      ``n_bins`` equal-width bins between them -- and *leaves*: every bin split into its
      whole numbers (an integer column whose bin holds at most ``sub_bins`` of them) or into
      ``sub_bins`` equal-width sub-cells. The release counts both levels; the link's cells
      are the leaves, so a repeated value, a skewed bulk or a tail is resolved to a leaf
      wherever the DP counts show it (:mod:`dpfed.common.synth.marginal_estimate`).

A leaf is a value range ``[lo, hi)`` (``lo == hi``: a point cell, decoded to that value);
integer columns' multi-number leaves decode to their whole numbers evenly.

A column the synthesizer models missingness of (``missing_cell``,
:mod:`dpfed.common.synth.missing_cells`) has one more leaf and coarse cell after the upper
bound's, the *missing* cell: a missing value (NaN) is counted there and it decodes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_choice, check_int

#: The two layouts (module docstring); "fine" is the default of new jobs.
RESOLUTIONS: tuple[str, ...] = ("fine", "bins")
#: Integer columns with at most this many whole numbers get one cell per whole number.
WHOLE_NUMBER_CELLS = 128
#: Most leaves per bin (fewer when the schema has many continuous columns).
MAX_SUB_BINS = 64
#: Fewest leaves per bin of a non-integer column.
MIN_SUB_BINS = 4
#: Total leaves of all continuous columns the layout aims at most for (bounds the size of
#: the link proportions every later round carries: 8 bytes a leaf).
LEAF_BUDGET = 1 << 17
#: Integer columns with more whole numbers than this decode by plain rounding.
_MAX_WHOLE_NUMBERS = 1 << 20


def check_resolution(value: object) -> str:
    """Validate a layout name (``resolution``), naming the parameter."""
    return check_choice(value, "resolution", RESOLUTIONS)


def sub_bins(schema: Schema, n_bins: int) -> int:
    """Leaves per bin of the "fine" layout: a power of two from the schema alone.

    ``MAX_SUB_BINS`` unless the schema's continuous columns would then exceed
    :data:`LEAF_BUDGET` leaves in total; never below :data:`MIN_SUB_BINS`.
    """
    b = check_int(n_bins, "n_bins", minimum=2)
    n_cont = sum(isinstance(c, ContinuousColumn) for c in schema.columns)
    if n_cont == 0:
        return MAX_SUB_BINS
    room = LEAF_BUDGET // (n_cont * b)
    s = MAX_SUB_BINS
    while s > MIN_SUB_BINS and s > room:
        s //= 2
    return s


@dataclass(frozen=True, eq=False)
class ColumnCells:
    """The cells of one continuous column under one layout (module docstring).

    Attributes
    ----------
    column : ContinuousColumn
    lo, hi : ndarray
        Value range of every leaf, in value order (``lo == hi``: a point cell).
    first, count : ndarray
        Integer columns: the first whole number of every leaf and how many it holds (decoded
        evenly over them); zeros for non-integer columns.
    coarse : ndarray
        The coarse cell of every leaf (non-decreasing, ``0..n_coarse-1``).
    n_coarse : int
        Coarse cells. ``has_fine`` is True when the release also counts the leaves (leaves
        differ from coarse cells).
    prior : ndarray
        Every leaf's share of the column's range before any data (its width; 1 for a whole
        number, 0 for a bound of a non-integer column): how an estimate spreads mass it has
        no evidence to place (:mod:`dpfed.common.synth.marginal_estimate`).
    has_missing : bool
        The last leaf (and coarse cell) is the *missing* cell (module docstring): its range
        is NaN, its prior 0.
    """

    column: ContinuousColumn
    lo: np.ndarray
    hi: np.ndarray
    first: np.ndarray
    count: np.ndarray
    coarse: np.ndarray
    n_coarse: int
    prior: np.ndarray
    kind: str
    n_bins: int
    sub: int
    has_missing: bool = False

    @property
    def n_leaves(self) -> int:
        """Number of leaves (the link's cells), the missing cell included."""
        return int(self.lo.shape[0])

    @property
    def n_value_leaves(self) -> int:
        """Number of leaves that hold values (all but the missing cell)."""
        return self.n_leaves - int(self.has_missing)

    @property
    def n_value_coarse(self) -> int:
        """Number of coarse cells that hold values (all but the missing cell)."""
        return self.n_coarse - int(self.has_missing)

    @property
    def has_fine(self) -> bool:
        """Whether the release counts the leaves as well as the coarse cells."""
        return self.n_leaves != self.n_coarse

    @property
    def fine_leaves(self) -> np.ndarray:
        """Indices of the leaves the fine level releases (every leaf inside a bin)."""
        if not self.has_fine:
            return np.zeros(0, dtype=np.intp)
        return np.arange(1, self.n_value_leaves - 1, dtype=np.intp)

    @property
    def release_size(self) -> int:
        """Cells this column adds to the link round's release (coarse, then fine)."""
        return self.n_coarse + (self.n_value_leaves - 2 if self.has_fine else 0)

    # ------------------------------------------------------------------ codes
    def codes(self, values: np.ndarray) -> np.ndarray:
        """Leaf of every value (values outside the bounds are clipped to them first).

        With a missing cell, NaN (a missing value) is counted in it.
        """
        if self.has_missing:
            raw = np.asarray(values, dtype=np.float64)
            absent = np.isnan(raw)
            out = self._value_codes(np.where(absent, self.column.min, raw))
            out[absent] = self.n_leaves - 1
            return out
        return self._value_codes(values)

    def _value_codes(self, values: np.ndarray) -> np.ndarray:
        col = self.column
        v = np.clip(np.asarray(values, dtype=np.float64), col.min, col.max)
        if self.kind == "bins":
            return np.asarray(_bin_codes(col, v, self.n_bins), dtype=np.intp)
        if self.kind == "whole":
            return np.asarray(np.rint(v) - col.min, dtype=np.intp)
        if col.integer:
            k = np.rint(v)
            table = _integer_leaf_table(col, self.n_bins, self.sub)
            if table is not None:
                return np.asarray(table[(k - col.min).astype(np.intp)], dtype=np.intp)
            v = k
        b = self.n_bins
        s = self.sub
        t = (v - col.min) * (b / (col.max - col.min))
        bins = np.clip(np.floor(t), 0, b - 1)
        within = np.clip(np.floor((t - bins) * s), 0, s - 1)
        out = (1 + bins * s + within).astype(np.intp)
        out[v <= col.min] = 0
        out[v >= col.max] = self.n_value_leaves - 1
        return np.asarray(out, dtype=np.intp)

    def coarse_codes(self, values: np.ndarray) -> np.ndarray:
        """Coarse cell of every value."""
        return np.asarray(self.coarse[self.codes(values)], dtype=np.intp)

    # ------------------------------------------------------------------ decode
    def values(self, leaves: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Values of ``leaves`` at relative ``position`` in [0, 1) inside each (float64).

        A point leaf decodes to its value; an interval leaf to ``lo + position (hi - lo)``;
        an integer column's multi-number leaf to its ``floor(position count)``-th whole
        number. Always within the schema bounds; the missing cell decodes to NaN.
        """
        k = np.asarray(leaves, dtype=np.intp)
        t = np.clip(np.asarray(position, dtype=np.float64), 0.0, 1.0 - 1e-12)
        if self.column.integer:
            out = self.first[k] + np.floor(t * self.count[k])
            if not np.all(self.count > 0):
                empty = self.count[k] == 0
                out[empty] = np.rint(self.lo[k[empty]] + t[empty] * (self.hi[k[empty]]
                                                                       - self.lo[k[empty]]))
        else:
            lo = self.lo[k]
            out = lo + t * (self.hi[k] - lo)
        return np.asarray(np.clip(out, self.column.min, self.column.max), dtype=np.float64)


def _bin_codes(column: ContinuousColumn, values: np.ndarray, n_bins: int) -> np.ndarray:
    width = (column.max - column.min) / n_bins
    codes = np.floor((values - column.min) / width)
    return np.clip(codes, 0, n_bins - 1).astype(np.intp)


def _whole_count(column: ContinuousColumn) -> int:
    return int(column.max) - int(column.min) + 1


@lru_cache(maxsize=512)
def _integer_leaf_table(column: ContinuousColumn, n_bins: int, sub: int) -> np.ndarray | None:
    """Leaf of every whole number of an integer column ("fine" with bins), or None if huge."""
    if _whole_count(column) > _MAX_WHOLE_NUMBERS:
        return None
    cells = column_cells(column, n_bins, sub, "fine")
    whole = np.arange(int(column.min), int(column.max) + 1, dtype=np.float64)
    # Every leaf holds [first, first + count) (integer columns): invert that map.
    table = np.zeros(whole.shape[0], dtype=np.intp)
    for leaf in range(cells.n_value_leaves):
        start = int(cells.first[leaf] - column.min)
        table[start:start + int(cells.count[leaf])] = leaf
    return table


@lru_cache(maxsize=2048)
def column_cells(column: ContinuousColumn, n_bins: int, sub: int,
                 resolution: str = "fine") -> ColumnCells:
    """Return the cells of ``column`` (cached: a pure function of public values)."""
    cells = _value_cells(column, n_bins, sub, resolution)
    return _with_missing_cell(cells) if column.missing_cell else cells


def _with_missing_cell(cells: ColumnCells) -> ColumnCells:
    """Append the missing cell: one more leaf and coarse cell, range NaN, prior 0."""
    nan = np.array([np.nan])
    return replace(cells, lo=np.concatenate([cells.lo, nan]),
                   hi=np.concatenate([cells.hi, nan]),
                   first=np.concatenate([cells.first, nan]),
                   count=np.concatenate([cells.count, [0.0]]),
                   coarse=np.concatenate([cells.coarse, [cells.n_coarse]]).astype(np.intp),
                   n_coarse=cells.n_coarse + 1, prior=np.concatenate([cells.prior, [0.0]]),
                   has_missing=True)


def _value_cells(column: ContinuousColumn, n_bins: int, sub: int,
                 resolution: str) -> ColumnCells:
    kind = check_resolution(resolution)
    b = check_int(n_bins, "n_bins", minimum=2)
    s = check_int(sub, "sub_bins", minimum=1)
    lo_v, hi_v = float(column.min), float(column.max)
    if not hi_v > lo_v:
        raise ValidationError(f"column {column.name!r}: max must exceed min")
    if kind == "bins":
        edges = np.linspace(lo_v, hi_v, b + 1)
        first, count = _bins_whole_numbers(column, b)
        return ColumnCells(column, edges[:-1].copy(), edges[1:].copy(), first, count,
                           np.arange(b, dtype=np.intp), b, np.diff(edges), "bins", b, s)
    if column.integer and _whole_count(column) <= max(WHOLE_NUMBER_CELLS, 2 * b):
        whole = np.arange(int(lo_v), int(hi_v) + 1, dtype=np.float64)
        n = whole.shape[0]
        return ColumnCells(column, whole, whole.copy(), whole.copy(), np.ones(n),
                           np.arange(n, dtype=np.intp), n, np.ones(n), "whole", b, s)
    return _fine_cells(column, b, s)


def _bins_whole_numbers(column: ContinuousColumn, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(first whole number, how many) of each equal-width bin (zeros if not integer)."""
    if not column.integer or _whole_count(column) > _MAX_WHOLE_NUMBERS:
        return np.zeros(n_bins), np.zeros(n_bins)
    whole = np.arange(int(column.min), int(column.max) + 1, dtype=np.float64)
    counts = np.bincount(_bin_codes(column, whole, n_bins), minlength=n_bins).astype(np.float64)
    first = column.min + np.concatenate([[0.0], np.cumsum(counts)[:-1]])
    return first, counts


def _fine_cells(column: ContinuousColumn, b: int, s: int) -> ColumnCells:
    """Build the "fine" cells of a column with bins: bound points, bins, leaves inside."""
    lo_v, hi_v = float(column.min), float(column.max)
    width = (hi_v - lo_v) / b
    los: list[np.ndarray] = [np.array([lo_v])]
    his: list[np.ndarray] = [np.array([lo_v])]
    firsts: list[np.ndarray] = [np.array([lo_v])]
    counts: list[np.ndarray] = [np.array([1.0 if column.integer else 0.0])]
    coarse: list[np.ndarray] = [np.array([0])]
    priors: list[np.ndarray] = [np.array([1.0 if column.integer else 0.0])]
    whole_in_bin = None
    if column.integer and _whole_count(column) <= _MAX_WHOLE_NUMBERS:
        # Whole numbers strictly between the bounds, by bin (the bounds are point cells).
        inner = np.arange(int(lo_v) + 1, int(hi_v), dtype=np.float64)
        whole_in_bin = _bin_codes(column, inner, b)
    for k in range(b):
        a = lo_v + k * width
        if whole_in_bin is not None:
            numbers = np.arange(int(lo_v) + 1, int(hi_v), dtype=np.float64)[whole_in_bin == k]
            if numbers.shape[0] <= s:
                n = max(numbers.shape[0], 0)
                los.append(numbers)
                his.append(numbers.copy())
                firsts.append(numbers.copy())
                counts.append(np.ones(n))
                priors.append(np.ones(n))
                coarse.append(np.full(n, k + 1))
                continue
        edges = a + width * np.arange(s + 1) / s
        los.append(edges[:-1])
        his.append(edges[1:])
        if whole_in_bin is not None:
            numbers = np.arange(int(lo_v) + 1, int(hi_v), dtype=np.float64)[whole_in_bin == k]
            pos = np.clip(np.floor((numbers - a) / width * s), 0, s - 1).astype(np.intp)
            c = np.bincount(pos, minlength=s).astype(np.float64)
            f = np.full(s, numbers[0] if numbers.size else a)
            starts = np.concatenate([[0], np.cumsum(c)[:-1]]).astype(np.intp)
            has = c > 0
            f[has] = numbers[starts[has]]
            firsts.append(f)
            counts.append(c)
            priors.append(c.copy())
        else:
            firsts.append(np.zeros(s))
            counts.append(np.zeros(s))
            priors.append(np.full(s, width / s))
        coarse.append(np.full(s, k + 1))
    los.append(np.array([hi_v]))
    his.append(np.array([hi_v]))
    firsts.append(np.array([hi_v]))
    counts.append(np.array([1.0 if column.integer else 0.0]))
    priors.append(np.array([1.0 if column.integer else 0.0]))
    coarse.append(np.array([b + 1]))
    return ColumnCells(column, np.concatenate(los), np.concatenate(his),
                       np.concatenate(firsts), np.concatenate(counts),
                       np.concatenate(coarse).astype(np.intp), b + 2,
                       np.concatenate(priors), "fine", b, s)


def schema_cells(schema: Schema, n_bins: int, resolution: str = "fine"
                 ) -> dict[str, ColumnCells]:
    """Return the cells of every continuous column of ``schema``, by name."""
    kind = check_resolution(resolution)
    s = sub_bins(schema, n_bins)
    return {c.name: column_cells(c, n_bins, s, kind) for c in schema.columns
            if isinstance(c, ContinuousColumn)}


def leaf_counts(cells: ColumnCells, values: np.ndarray) -> np.ndarray:
    """Exact count of every leaf over ``values`` (site-internal)."""
    return np.bincount(cells.codes(values), minlength=cells.n_leaves)[:cells.n_leaves]


def release_counts(cells: ColumnCells, leaves: np.ndarray) -> np.ndarray:
    """Return a column's release block from its exact leaf counts: coarse cells, then leaves."""
    lv = np.asarray(leaves)
    coarse = np.bincount(cells.coarse, weights=lv, minlength=cells.n_coarse)
    if not cells.has_fine:
        return np.asarray(coarse)
    return np.concatenate([coarse, lv[cells.fine_leaves]])
