"""A synthetic table against real rows, column by column: marginals, point masses, tails.

**Only where real rows may be read**: ``dpfed simulate`` (it generated every site's rows)
and a site's own evaluation report (its rows never leave it). Nothing here is a DP release
and nothing computed here is sent anywhere.

Per continuous column (:func:`column_fidelity`): the TVD on cells cut at the 20-quantiles of
the real rows, each cut halfway between two neighbouring distinct real values (so a point
mass -- zero visits, a floor, values recorded in half years -- sits inside its cell and
counts as matched only if the synthetic rows put their mass on it; the benchmarks score on
the same cells), the share of the most common real value in both tables, and the 1st, 50th
and 99th percentiles and the standard deviation of both. Per categorical column: the TVD on
its categories. A ``missing = "category"`` column's missing values are one more cell of its
TVD, its tails and point masses are those of its values, and both tables' missing rates are
reported. Date columns are compared in their units (both tables encoded alike) and shown
as dates (:meth:`ColumnFidelity.texts`). :func:`released_quantile_band` is the range in
which a quantile of the real rows is expected given the DP release a model was fitted to
(its public noise level): the accuracy the budget allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Column, ContinuousColumn, DateColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.synth.column_cells import ColumnCells

#: Cells of the 1-way comparison of a continuous column (quantiles of the real rows).
COMPARISON_CELLS = 20


def quantile_cuts(values: np.ndarray, k: int = COMPARISON_CELLS) -> np.ndarray:
    """Cuts of ``k`` about equally likely cells, each halfway between two distinct values."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    distinct = np.unique(v)
    if distinct.size < 2:
        return np.zeros(0)
    q = np.quantile(v, np.arange(1, k) / k, method="lower")
    at = np.unique(np.searchsorted(distinct, q))
    at = at[at > 0]
    return np.asarray((distinct[at - 1] + distinct[at]) / 2.0)


def _tvd(a: np.ndarray, b: np.ndarray, size: int) -> float:
    pa = np.bincount(a, minlength=size) / max(a.size, 1)
    pb = np.bincount(b, minlength=size) / max(b.size, 1)
    return 0.5 * float(np.abs(pa - pb).sum())


@dataclass(frozen=True)
class ColumnFidelity:
    """One column of a synthetic table against the real rows (see the module docstring).

    ``tail`` is None for categorical columns (and columns without values); else ``(p1, p50,
    p99, sd)`` of the real and of the synthetic values, and ``mode`` the most common real
    value with its share in both. ``missing`` is (real, synthetic) missing rate for a
    ``missing = "category"`` column, else None.
    """

    column: str
    kind: str
    tvd: float
    real_tail: tuple[float, float, float, float] | None = None
    synthetic_tail: tuple[float, float, float, float] | None = None
    mode: tuple[float, float, float] | None = None
    missing: tuple[float, float] | None = None

    def texts(self, column: Column) -> tuple[str, ...]:
        """Return (missing rate, most common value: shares, p1, p50, p99, sd) as text.

        Each "real / synthetic"; "-" where the column has none. ``column`` is this
        column's schema entry: dates show as dates and their sd in their units.
        """
        absent = "-" if self.missing is None else f"{self.missing[0]:.3f} / {self.missing[1]:.3f}"
        mode = "-" if self.mode is None else (
            f"{value_text(column, self.mode[0])}: {self.mode[1]:.3f} / {self.mode[2]:.3f}")
        real, syn = self.real_tail, self.synthetic_tail
        if real is None or syn is None:
            return absent, mode, "-", "-", "-", "-"
        return (absent, mode,
                *(f"{value_text(column, a)} / {value_text(column, b)}"
                  for a, b in zip(real[:3], syn[:3], strict=True)),
                f"{spread_text(column, real[3])} / {spread_text(column, syn[3])}")


def value_text(column: Column, value: float) -> str:
    """Return a value of ``column`` as reports show it: ISO 8601 for dates, else 4 digits."""
    if isinstance(column, DateColumn):
        return column.iso(round(value))
    return f"{value:.4g}"


def spread_text(column: Column, value: float) -> str:
    """Return a standard deviation as reports show it: ``12.5 days`` for a date column."""
    if isinstance(column, DateColumn):
        return f"{value:.4g} {column.resolution}s"
    return f"{value:.4g}"


def _tail(v: np.ndarray) -> tuple[float, float, float, float]:
    p1, p50, p99 = np.quantile(v, [0.01, 0.5, 0.99])
    return float(p1), float(p50), float(p99), float(np.std(v))


def column_fidelity(schema: Schema, real: EncodedTable,
                    synthetic: EncodedTable) -> list[ColumnFidelity]:
    """Compare every column of ``synthetic`` with ``real`` (module docstring)."""
    if real.n_rows < 2 or synthetic.n_rows < 2:
        raise ValidationError("need at least two real and two synthetic rows to compare")
    out = []
    for col in schema.columns:
        r, s = real.columns[col.name], synthetic.columns[col.name]
        cell = col.missing == "category"
        rm, sm = real.missing_mask(col.name), synthetic.missing_mask(col.name)
        missing = (float(rm.mean()), float(sm.mean())) if cell else None
        if isinstance(col, ContinuousColumn):
            rv = np.asarray(r, dtype=np.float64)[~rm]
            sv = np.asarray(s, dtype=np.float64)[~sm]
            cuts = quantile_cuts(rv)
            tvd = _tvd(_with_missing(np.searchsorted(cuts, r, side="right"), rm, cuts.size + 1),
                       _with_missing(np.searchsorted(cuts, s, side="right"), sm, cuts.size + 1),
                       cuts.size + 1 + int(cell))
            if rv.size == 0 or sv.size == 0:
                out.append(ColumnFidelity(col.name, col.type, tvd, missing=missing))
                continue
            values, counts = np.unique(rv, return_counts=True)
            top = float(values[int(np.argmax(counts))])
            mode = (top, float(np.mean(rv == top)), float(np.mean(sv == top)))
            out.append(ColumnFidelity(col.name, col.type, tvd, _tail(rv), _tail(sv), mode,
                                      missing))
        else:
            size = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
            out.append(ColumnFidelity(col.name, col.type,
                                      _tvd(_with_missing(np.asarray(r, dtype=np.intp), rm, size),
                                           _with_missing(np.asarray(s, dtype=np.intp), sm, size),
                                           size + int(cell)), missing=missing))
    return out


def _with_missing(codes: np.ndarray, mask: np.ndarray, cell: int) -> np.ndarray:
    """``codes`` with the missing rows in cell ``cell``."""
    return np.where(mask, cell, codes) if mask.any() else codes


def released_quantile_band(cells: ColumnCells, proportions: np.ndarray, coarse_sd: np.ndarray,
                           n_rows: float, q: float, spread: float = 2.0
                           ) -> tuple[float, float, float]:
    """Return the released ``q``-quantile and the band the noise of its release allows.

    ``proportions`` are the column's DP proportions on its cells (leaves), ``coarse_sd`` the
    public noise standard deviation of each coarse cell's summed count and ``n_rows`` the
    public pooled row count. The mass the release puts beyond the quantile carries the noise
    of the coarse cells it kept there: standard deviation ``s = sqrt(their variances' sum) /
    N``; the band runs from the coarse cell of the released quantile at ``q - spread s`` to
    that of ``q + spread s`` (the release resolves its coarse cells; inside one, only where
    the leaves stood out from the noise): where the real rows' quantile lies for most noise
    draws. It ignores the estimate's own bias (tails too thin to tell from the noise are cut
    off). Returns (low, released quantile, high).
    """
    p = np.asarray(proportions, dtype=np.float64)
    sd = np.asarray(coarse_sd, dtype=np.float64)
    if p.shape != (cells.n_leaves,) or sd.shape != (cells.n_coarse,):
        raise ValidationError("proportions must be one per leaf and coarse_sd one per coarse cell")
    # Quantiles of the values: a missing cell (the last leaf and coarse cell) is left out.
    leaves, coarse = cells.n_value_leaves, cells.n_value_coarse
    p, sd = p[:leaves], sd[:coarse]
    cdf = np.concatenate([[0.0], np.cumsum(p / p.sum())])

    def quantile(level: float) -> float:
        u = min(max(level, 0.0), 1.0)
        k = int(np.clip(np.searchsorted(cdf, u, side="right") - 1, 0, leaves - 1))
        t = (u - cdf[k]) / max(p[k] / p.sum(), 1e-300)
        return float(cells.values(np.array([k]), np.array([t]))[0])

    x = quantile(q)
    beyond = cells.coarse[cells.codes(np.array([x]))[0]]
    kept = np.bincount(cells.coarse[:leaves], weights=p, minlength=coarse) > 1e-4 * p.sum()
    kept[:beyond] = False
    s = float(np.sqrt(np.sum(sd[kept] ** 2))) / max(float(n_rows), 1.0)
    # The release resolves its coarse cells; inside one, the leaves only where they stood out
    # from the noise: the band spans the coarse cells its ends fall in.
    low = cells.coarse[cells.codes(np.array([quantile(q - spread * s)]))[0]]
    high = cells.coarse[cells.codes(np.array([quantile(q + spread * s)]))[0]]
    return (float(cells.lo[cells.coarse == low].min()), x,
            float(cells.hi[cells.coarse == high].max()))
