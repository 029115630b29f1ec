"""Map schema-typed rows to numeric feature vectors inside the unit L2 ball.

DP-PCA needs every row to satisfy ||x||_2 <= 1 so that one row moves the second-moment
matrix by at most 1/N in Frobenius norm. DPdisPCA's reference code gets there by dividing by
the largest row norm *in the data*, which leaks (docs/algorithms.md). Here the map uses only the
public
schema and a public ``clip_norm``:

1. Each column to [-1, 1] with its declared bounds: continuous (and date: days since the
   epoch) ``(x - mid) / half_range``; ordinal code ``c`` of M levels ``2c/(M-1) - 1``; nominal
   one-hot (Q features in {0, 1}). A ``missing = "category"`` column is 0 where missing (a
   nominal one: no category set) and, unless nominal, gets one more feature, its *missing
   indicator* ``name (missing)`` in {0, 1}; a column's features then still have norm <= 1.
2. Rows whose norm exceeds ``clip_norm`` are scaled down to it (counted, not dropped).
3. Divide by ``clip_norm``.

The default ``clip_norm`` is the largest norm step 1 can produce (sqrt of the number of
columns), so by default nothing is ever clipped; a smaller public value trades clipping bias
for less relative noise.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import (
    Column,
    ContinuousColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)
from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_positive

#: Suffix of a missing indicator's feature name.
MISSING_SUFFIX = " (missing)"


def has_indicator(col: Column) -> bool:
    """Whether a column gets a missing-indicator feature (``"category"``, not nominal)."""
    return col.missing == "category" and not isinstance(col, NominalColumn)


def feature_names(schema: Schema) -> tuple[str, ...]:
    """Names of the numeric features, in order.

    Column names, ``column=category`` for one-hots, and ``column (missing)`` for missing
    indicators (right after their column's feature).
    """
    names: list[str] = []
    for col in schema.columns:
        if isinstance(col, NominalColumn):
            names.extend(f"{col.name}={c}" for c in col.categories)
        else:
            names.append(col.name)
            if has_indicator(col):
                names.append(col.name + MISSING_SUFFIX)
    return tuple(names)


def max_feature_norm(schema: Schema) -> float:
    """Return the largest L2 norm a row can have after step 1 (one per column)."""
    return math.sqrt(len(schema.columns))


def feature_affine(schema: Schema) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(offset, scale)`` with ``raw = offset + scale * u`` for step 1's ``u``, per feature.

    Raw units: a continuous column's own unit (a date's: units since the epoch), an ordinal
    column's level code (0 .. M-1), a one-hot's or missing indicator's 0/1 (so a mean is a
    share). The inverse of step 1.
    """
    offset: list[float] = []
    scale: list[float] = []
    for col in schema.columns:
        if isinstance(col, ContinuousColumn):
            offset.append(col.center)
            scale.append(col.half_range)
        elif isinstance(col, OrdinalColumn):
            offset.append((col.n_levels - 1) / 2.0)
            scale.append((col.n_levels - 1) / 2.0)
        else:
            offset.extend([0.0] * col.n_categories)
            scale.extend([1.0] * col.n_categories)
        if has_indicator(col):
            offset.append(0.0)
            scale.append(1.0)
    return np.asarray(offset), np.asarray(scale)


def _clip_unit_rows(x: np.ndarray) -> int:
    """Scale the rows of ``x`` longer than 1 onto the unit sphere in place; return how many."""
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    over = norms > 1.0
    n_clipped = int(np.count_nonzero(over))
    if n_clipped:
        x[over] /= norms[over][:, None]
    return n_clipped


class _ReusedMatrices:
    """Flat float64 buffers lent out as column-major (n, p) views, reused once unreferenced.

    A fresh 52 MiB matrix per chunk (65536 rows x p = 100) cost the site's pass 18% in page
    faults: the allocator returns such blocks to the system and every new one is faulted in
    again. A buffer is lent again only when nothing refers to it any more -- neither the view
    lent out nor anything derived from it (a derived view's ``base`` is the buffer itself) --
    which CPython's reference count tells exactly. At most :data:`KEPT` buffers are kept (a
    loop ``x = map.scaled(chunk)`` holds the previous chunk while the next is filled).
    """

    KEPT = 2

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def matrix(self, n: int, p: int) -> np.ndarray:
        size = n * p
        with self._lock:
            for i in range(len(self._buffers)):
                # References: the list, and getrefcount's own argument.
                if sys.getrefcount(self._buffers[i]) == 2 and self._buffers[i].size >= size:
                    return self._buffers[i][:size].reshape((n, p), order="F")
            buf = np.empty(max(size, 1), dtype=np.float64)
            free = [i for i in range(len(self._buffers))
                    if sys.getrefcount(self._buffers[i]) == 2]
            if free:
                self._buffers[free[0]] = buf
            elif len(self._buffers) < self.KEPT:
                self._buffers.append(buf)
            return buf[:size].reshape((n, p), order="F")


@dataclass(frozen=True)
class UnitBallMap:
    """Schema-driven map from encoded rows to features with ||x||_2 <= 1.

    Parameters
    ----------
    schema : Schema
        Public bounds, levels and categories.
    clip_norm : float, optional
        Public norm bound applied after scaling each column to [-1, 1]; default
        :func:`max_feature_norm` (no clipping).
    """

    schema: Schema
    clip_norm: float | None = None
    names: tuple[str, ...] = field(init=False)
    norm: float = field(init=False)
    clips_nothing: bool = field(init=False)
    _matrices: _ReusedMatrices = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_matrices", _ReusedMatrices())
        norm = max_feature_norm(self.schema) if self.clip_norm is None else check_positive(
            self.clip_norm, "clip_norm")
        object.__setattr__(self, "norm", float(norm))
        object.__setattr__(self, "names", feature_names(self.schema))
        # No row can exceed the norm after step 1 (the default clip_norm): step 2 is a no-op.
        object.__setattr__(self, "clips_nothing", self.norm >= max_feature_norm(self.schema))

    @property
    def n_features(self) -> int:
        """Number of numeric features p."""
        return len(self.names)

    def scaled(self, table: EncodedTable) -> np.ndarray:
        """Step 1 only: every column to [-1, 1] (n x p, float64, Fortran (column-major) order).

        Column-major because every source column fills one or more whole feature columns
        (contiguous writes, ~3x faster than filling a row-major matrix column by column), and
        :class:`~dpfed.common.pca.dppca.GramAccumulator` takes the matrix as it is. The matrix
        may reuse the memory of one this map returned earlier that is no longer referenced
        (:class:`_ReusedMatrices`); hold on to it (or a view of it) to keep it.
        """
        return self._fill(table, 1.0)

    def column_sums(self, table: EncodedTable) -> np.ndarray:
        """Return ``scaled(table).sum(axis=0)`` without building the n x p matrix.

        The ``mean`` round needs only these sums; filling the matrix first cost that pass
        21%. Per column: a continuous sum, an ordinal sum of codes, a one-hot's count, a
        missing indicator's count, each scaled like step 1 (missing rows contribute 0 to
        their column's value feature).
        """
        self._check_schema(table)
        n = table.n_rows
        out = np.zeros(self.n_features)
        j = 0
        for col in self.schema.columns:
            values = table.columns[col.name]
            missing = table.missing.get(col.name) if col.missing == "category" else None
            present = n if missing is None else n - int(np.count_nonzero(missing))
            kept = values if missing is None else values[~missing]
            if isinstance(col, ContinuousColumn):
                out[j] = (float(np.sum(kept)) - present * col.center) / col.half_range
                j += 1
            elif isinstance(col, OrdinalColumn):
                out[j] = float(np.sum(kept, dtype=np.int64)) * 2.0 / (col.n_levels - 1) - present
                j += 1
            else:
                out[j:j + col.n_categories] = np.bincount(kept, minlength=col.n_categories)
                j += col.n_categories
            if has_indicator(col):
                out[j] = n - present
                j += 1
        return out

    def _check_schema(self, table: EncodedTable) -> None:
        # Identity first: the digest serialises the whole schema (34 ms at p = 2000).
        if table.schema is not self.schema and table.schema.digest() != self.schema.digest():
            raise ValidationError("table was encoded with a different schema than this map")

    def _fill(self, table: EncodedTable, factor: float,
              shift: np.ndarray | None = None) -> np.ndarray:
        """``(step 1 - shift) * factor``, in one pass per column (``shift`` in step-1 units)."""
        self._check_schema(table)
        n = table.n_rows
        out = self._matrices.matrix(n, self.n_features)
        s = np.zeros(self.n_features) if shift is None else shift
        j = 0
        for col in self.schema.columns:
            values = table.columns[col.name]
            missing = table.missing.get(col.name) if col.missing == "category" else None
            if isinstance(col, ContinuousColumn):
                # ((v - mid) / h - s) * factor = (v - (mid + s h)) * (factor / h).
                np.subtract(values, col.center + s[j] * col.half_range, out=out[:, j])
                out[:, j] *= factor / col.half_range
                width = 1
            elif isinstance(col, OrdinalColumn):
                step = 2.0 / (col.n_levels - 1)
                np.multiply(values, step * factor, out=out[:, j])
                out[:, j] -= (1.0 + s[j]) * factor
                width = 1
            else:
                width = col.n_categories
                block = out[:, j:j + width]
                block[:] = -s[j:j + width] * factor
                rows = np.arange(n) if missing is None else np.flatnonzero(~missing)
                codes = values[rows]
                block[rows, codes] = (1.0 - s[j + codes]) * factor
            if missing is not None:
                out[missing, j:j + width] = -s[j:j + width] * factor
            j += width
            if has_indicator(col):
                if missing is None:
                    out[:, j] = -s[j] * factor
                else:
                    np.subtract(missing, s[j], out=out[:, j])
                    out[:, j] *= factor
                j += 1
        return out

    def transform(self, table: EncodedTable) -> tuple[np.ndarray, int]:
        """Return (features with every row norm <= 1, number of rows that were clipped).

        Steps 1-3 of the module docstring. The division by ``clip_norm`` is folded into the
        per-column scaling; row norms are computed only when a row can exceed ``clip_norm``
        (not under the default, where step 2 is a no-op).
        """
        x = self._fill(table, 1.0 / self.norm)
        if self.clips_nothing:
            return x, 0
        return x, _clip_unit_rows(x)

    def centred(self, table: EncodedTable, center: np.ndarray) -> tuple[np.ndarray, int]:
        """Return ``(clip_c(u - center) / c, n_clipped)`` with ``c = norm``, in one fill.

        Equal to :func:`dpfed.common.pca.centring.centre_rows` of :meth:`scaled` (up to
        rounding), without its three extra passes over the matrix (subtract, scale every row,
        and the copy of the scale vector): the centre and ``1 / c`` are folded into the
        per-column fill and only rows longer than ``c`` are rescaled.
        """
        if center.shape != (self.n_features,):
            raise ValidationError(f"center must have shape ({self.n_features},), got "
                                  f"{center.shape}")
        x = self._fill(table, 1.0 / self.norm, center)
        return x, _clip_unit_rows(x)

    def clip_rows(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """Scale rows of step-1 features into the unit ball in place; return (x, n_clipped)."""
        norms = np.sqrt(np.einsum("ij,ij->i", x, x))
        over = norms > self.norm
        n_clipped = int(np.count_nonzero(over))
        scale = np.full(x.shape[0], 1.0 / self.norm)
        if n_clipped:
            scale[over] = 1.0 / norms[over]
        x *= scale[:, None]
        return x, n_clipped
