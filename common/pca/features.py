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

    def __post_init__(self) -> None:
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
        :class:`~dpfed.common.pca.dppca.GramAccumulator` takes the matrix as it is.
        """
        return self._fill(table, 1.0)

    def _fill(self, table: EncodedTable, factor: float) -> np.ndarray:
        """Step 1 followed by a multiplication by ``factor``, in one pass per column."""
        # Identity first: the digest serialises the whole schema (34 ms at p = 2000).
        if table.schema is not self.schema and table.schema.digest() != self.schema.digest():
            raise ValidationError("table was encoded with a different schema than this map")
        n = table.n_rows
        out = np.empty((n, self.n_features), dtype=np.float64, order="F")
        j = 0
        for col in self.schema.columns:
            values = table.columns[col.name]
            missing = table.missing.get(col.name) if col.missing == "category" else None
            if isinstance(col, ContinuousColumn):
                # (v - center) / half_range * factor as one subtract and one multiply.
                np.subtract(values, col.center, out=out[:, j])
                out[:, j] *= factor / col.half_range
                width = 1
            elif isinstance(col, OrdinalColumn):
                step = 2.0 / (col.n_levels - 1)
                np.multiply(values, step * factor, out=out[:, j])
                out[:, j] -= factor
                width = 1
            else:
                width = col.n_categories
                block = out[:, j:j + width]
                block[:] = 0.0
                rows = np.arange(n) if missing is None else np.flatnonzero(~missing)
                block[rows, values[rows]] = factor
            if missing is not None:
                out[missing, j:j + width] = 0.0
            j += width
            if has_indicator(col):
                if missing is None:
                    out[:, j] = 0.0
                else:
                    np.multiply(missing, factor, out=out[:, j])
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
        # Rows of x are step-1 rows divided by norm: clip those longer than 1.
        norms = np.sqrt(np.einsum("ij,ij->i", x, x))
        over = norms > 1.0
        n_clipped = int(np.count_nonzero(over))
        if n_clipped:
            x[over] /= norms[over][:, None]
        return x, n_clipped

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
