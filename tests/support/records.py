"""Extreme schema-valid records: the search space of the sensitivity searches."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd

from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema


def column_values(col: ContinuousColumn | OrdinalColumn | NominalColumn, *,
                  quarters: bool = True, outside: bool = True, fine: bool = False) -> list[Any]:
    """Extreme values of one column: its bounds and midpoint (and the quarter points, values
    outside the bounds -- the encoding clips those -- or a fine grid); every level/category."""
    if isinstance(col, OrdinalColumn):
        return list(col.levels)
    if isinstance(col, NominalColumn):
        return list(col.categories)
    lo, hi = col.min, col.max
    width = hi - lo
    values = [lo, lo + 0.5 * width, hi]
    if quarters:
        values = [lo, lo + 0.25 * width, lo + 0.5 * width, lo + 0.75 * width, hi]
    if outside:
        values += [lo - width, hi + 3 * width]
    if fine:
        values += list(np.linspace(lo, hi, 17))
    return values


def extreme_records(schema: Schema, **kwargs: Any) -> pd.DataFrame:
    """Every combination of every column's extreme values (:func:`column_values`)."""
    grids = [column_values(c, **kwargs) for c in schema.columns]
    return pd.DataFrame(list(itertools.product(*grids)), columns=[c.name for c in schema.columns])


def random_rows(schema: Schema, n: int, seed: int) -> pd.DataFrame:
    """``n`` random schema-valid rows (the rows a neighbouring pair shares)."""
    rng = np.random.default_rng(seed)
    data: dict[str, Any] = {}
    for col in schema.columns:
        if isinstance(col, ContinuousColumn):
            data[col.name] = rng.uniform(col.min, col.max, n)
        elif isinstance(col, OrdinalColumn):
            data[col.name] = rng.choice(list(col.levels), n)
        else:
            data[col.name] = rng.choice(list(col.categories), n)
    return pd.DataFrame(data)
