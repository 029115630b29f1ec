"""Missing values as a cell of their own in the synthesizer's releases, links and outputs.

A ``missing = "category"`` column keeps rows whose value is missing; the encoding holds its
public fill value there and marks the row in :attr:`EncodedTable.missing`. For a synthesis
job with ``missing_cells`` (new jobs), every such column gets one more cell, *missing*
(:func:`cells_schema`):

* a nominal column one more category, an ordinal column one more level above its highest
  (the top end of its latent thresholds);
* a continuous or date column one more leaf and coarse cell after its upper bound
  (:mod:`dpfed.common.synth.column_cells`): the top end of its quantile link, a point mass
  that decodes to NaN.

A site turns its encoded chunks into rows of that schema (:func:`to_cells_table`: NaN or
the extra code where a value is missing) and every round reads those; the synthetic rows
come back with real missing values (:func:`from_cells_table`). A row still falls in exactly
one cell of every column, so every release's replace-one sensitivity is unchanged.
docs/synthesis.md says why the missing cell sits at the top end of the column's link.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.schema import Column, ContinuousColumn, NominalColumn, OrdinalColumn, Schema

if TYPE_CHECKING:
    from dpfed.common.jobs.contract import DataAccess

#: The label of the missing cell of an ordinal or nominal column (primes added if taken).
MISSING_LABEL = "(missing)"


def _label(labels: tuple[str, ...]) -> str:
    label = MISSING_LABEL
    while label in labels:
        label += "'"
    return label


def _with_cell(col: Column) -> Column:
    if col.missing != "category" or col.missing_cell:  # complete, or already has its cell
        return col
    if isinstance(col, ContinuousColumn):
        return replace(col, missing_cell=True)
    if isinstance(col, OrdinalColumn):
        return replace(col, levels=(*col.levels, _label(col.levels)), missing_cell=True)
    assert isinstance(col, NominalColumn)
    return replace(col, categories=(*col.categories, _label(col.categories)),
                   missing_cell=True)


def cells_schema(schema: Schema) -> Schema:
    """Return the schema the synthesizer's cells follow: a missing cell per "category" column.

    The schema itself when no column needs a cell (none has ``missing = "category"``, or
    ``schema`` already is a cells schema).
    """
    if not any(c.missing == "category" and not c.missing_cell for c in schema.columns):
        return schema
    return replace(schema, columns=tuple(_with_cell(c) for c in schema.columns))


def synth_schema(schema: Schema, missing_cells: bool) -> Schema:
    """Return the schema a synthesis job's cells follow (:func:`cells_schema` if asked)."""
    return cells_schema(schema) if missing_cells else schema


def _n_codes(col: OrdinalColumn | NominalColumn) -> int:
    return col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories


def to_cells_table(table: EncodedTable, cells: Schema) -> EncodedTable:
    """Return ``table``'s rows under ``cells`` (:func:`cells_schema`): missing values as cells.

    A missing continuous value becomes NaN, a missing ordinal or nominal one the extra last
    code. ``table`` itself when ``cells`` is its schema.
    """
    if cells is table.schema:
        return table
    columns = dict(table.columns)
    for col in cells.columns:
        if not col.missing_cell:
            continue
        mask = table.missing_mask(col.name)
        values = table.columns[col.name]
        if isinstance(col, ContinuousColumn):
            columns[col.name] = np.where(mask, np.nan, values)
        else:
            columns[col.name] = np.where(mask, _n_codes(col) - 1, values).astype(values.dtype)
    return EncodedTable(cells, columns, table.n_rows)


def from_cells_table(table: EncodedTable, schema: Schema) -> EncodedTable:
    """Return synthetic rows under ``cells_schema(schema)`` as rows of ``schema``.

    A value in a missing cell becomes a missing value: the column's fill value, marked in
    :attr:`EncodedTable.missing` (so outputs hold NaN, NA, NaT or null there).
    """
    if table.schema is schema:
        return table
    columns = dict(table.columns)
    missing: dict[str, np.ndarray] = {}
    for col, cell in zip(schema.columns, table.schema.columns, strict=True):
        if not cell.missing_cell:
            continue
        values = table.columns[col.name]
        if isinstance(col, ContinuousColumn):
            mask = np.isnan(values)
            columns[col.name] = np.where(mask, col.fill_value, values)
        else:
            assert isinstance(cell, OrdinalColumn | NominalColumn)
            assert isinstance(col, OrdinalColumn | NominalColumn)
            mask = values == _n_codes(cell) - 1
            columns[col.name] = np.where(mask, col.fill_code, values).astype(values.dtype)
        if mask.any():
            missing[col.name] = mask
    return EncodedTable(schema, columns, table.n_rows, missing)


class CellRows:
    """A site's rows as the synthesizer's cells see them (:func:`to_cells_table` per chunk)."""

    def __init__(self, data: DataAccess, cells: Schema) -> None:
        self._data = data
        self._cells = cells

    @property
    def schema(self) -> Schema:
        """The cells' schema (:func:`cells_schema`)."""
        return self._cells

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        """Stream the chunks, missing values turned into cells."""
        for table, report in self._data.iter_chunks():
            yield to_cells_table(table, self._cells), report
