"""Turn tables (Arrow batches or pandas DataFrames) into validated, schema-typed arrays.

Continuous columns become float64 arrays, date columns float64 unit counts
(:mod:`dpfed.common.data.dates`), ordinal and nominal columns integer codes (``0..M-1`` in
the schema's order). A missing value follows its column's ``missing`` mode: under
``"category"`` the row is kept, the value holds the column's public fill value and
:attr:`EncodedTable.missing` marks it; under ``"impute"`` it holds the public ``impute`` value;
under ``"drop-row"`` the row is dropped; in a column declared complete (no ``missing`` key)
the :class:`RowPolicy` decides (stop, by default, or drop). Values outside a nominal
column's categories become ``"other"`` where the schema allows it. Other problem rows are
handled by the row policy -- dropped by default, never a crash -- and everything is counted in
an :class:`EncodingReport` that stays at the site (counts and column names, never data values,
so it is safe to log).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpfed.common.data import dates
from dpfed.common.data.schema import (
    Column,
    ContinuousColumn,
    DateColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)
from dpfed.common.errors import DataError
from dpfed.common.validation import check_choice

if TYPE_CHECKING:  # pandas is imported where a frame is built or read (slow to import)
    import pandas as pd

_MISSING_ACTIONS = ("drop", "error")
_OUT_OF_RANGE_ACTIONS = ("clip", "drop", "error")


@dataclass(frozen=True)
class RowPolicy:
    """What to do with problem rows.

    Attributes
    ----------
    missing : {"error", "drop"}
        A value is empty or one of the schema's ``missing_values`` (or NaN) in a column the
        schema declares complete (no ``missing`` key). ``"error"`` (the default) stops with a
        message naming the columns, so no row is dropped silently; ``"drop"`` drops the row
        (counted). Columns with a ``missing`` mode follow it instead.
    invalid : {"drop", "error"}
        A value cannot be parsed as a number, is infinite, or is not a declared level/category.
    out_of_range : {"clip", "drop", "error"}
        A continuous value lies outside the schema's ``[min, max]``. ``clip`` (the default)
        moves it to the nearest bound, which keeps the declared sensitivity valid.
    """

    missing: str = "error"
    invalid: str = "drop"
    out_of_range: str = "clip"

    def __post_init__(self) -> None:
        check_choice(self.missing, "on_missing", _MISSING_ACTIONS)
        check_choice(self.invalid, "on_invalid", _MISSING_ACTIONS)
        check_choice(self.out_of_range, "on_out_of_range", _OUT_OF_RANGE_ACTIONS)


@dataclass
class EncodingReport:
    """Counts of what happened while encoding (safe to log: counts and column names only)."""

    rows_read: int = 0
    rows_kept: int = 0
    dropped_missing: int = 0
    dropped_invalid: int = 0
    dropped_out_of_range: int = 0
    values_clipped: int = 0
    #: Missing values kept as a value of their own (``missing = "category"``), in kept rows.
    values_missing_kept: int = 0
    #: Missing values replaced by the schema's public ``impute`` value, in kept rows.
    values_imputed: int = 0
    #: Undeclared values read as ``"other"`` (``other = true``), in kept rows.
    values_to_other: int = 0
    problems_by_column: dict[str, dict[str, int]] = field(default_factory=dict)

    def merge(self, other: EncodingReport) -> None:
        """Add ``other``'s counts into this report."""
        self.rows_read += other.rows_read
        self.rows_kept += other.rows_kept
        self.dropped_missing += other.dropped_missing
        self.dropped_invalid += other.dropped_invalid
        self.dropped_out_of_range += other.dropped_out_of_range
        self.values_clipped += other.values_clipped
        self.values_missing_kept += other.values_missing_kept
        self.values_imputed += other.values_imputed
        self.values_to_other += other.values_to_other
        for col, counts in other.problems_by_column.items():
            mine = self.problems_by_column.setdefault(col, {})
            for kind, n in counts.items():
                mine[kind] = mine.get(kind, 0) + n

    def _count(self, column: str, kind: str, n: int) -> None:
        if n:
            col = self.problems_by_column.setdefault(column, {})
            col[kind] = col.get(kind, 0) + n

    def summary(self) -> str:
        """One line for the site's log."""
        parts = [f"read {self.rows_read} rows, kept {self.rows_kept}"]
        if self.dropped_missing:
            parts.append(f"dropped {self.dropped_missing} with missing values")
        if self.dropped_invalid:
            parts.append(f"dropped {self.dropped_invalid} with invalid values")
        if self.dropped_out_of_range:
            parts.append(f"dropped {self.dropped_out_of_range} out of range")
        if self.values_clipped:
            parts.append(f"clipped {self.values_clipped} values to the schema bounds")
        if self.values_missing_kept:
            parts.append(f"kept {self.values_missing_kept} missing values as 'missing'")
        if self.values_imputed:
            parts.append(f"imputed {self.values_imputed} missing values")
        if self.values_to_other:
            parts.append(f"read {self.values_to_other} undeclared categories as 'other'")
        return "; ".join(parts)

    @property
    def rows_dropped(self) -> int:
        """Rows read but not kept, for any reason."""
        return self.rows_read - self.rows_kept


@dataclass(frozen=True)
class EncodedTable:
    """Validated rows: float64 arrays for continuous and date columns, int32 codes otherwise.

    ``missing`` maps the name of a ``missing = "category"`` column to a boolean mask of its
    missing rows -- only for columns with at least one missing value in these rows (use
    :meth:`missing_mask`). A missing entry still holds a valid value (the column's
    ``fill_value`` / ``fill_code``), so a consumer that ignores ``missing`` reads in-bounds
    values; one that models missingness reads the mask (or :func:`codes_with_missing`).
    """

    schema: Schema
    columns: Mapping[str, np.ndarray]
    n_rows: int
    missing: Mapping[str, np.ndarray] = field(default_factory=dict)

    def missing_mask(self, name: str) -> np.ndarray:
        """Boolean mask of the rows where column ``name`` is missing (all False if none)."""
        mask = self.missing.get(name)
        return np.zeros(self.n_rows, dtype=bool) if mask is None else mask

    def take(self, rows: np.ndarray) -> EncodedTable:
        """Return the rows ``rows`` selects (a boolean mask or indices), missing marks kept."""
        index = np.asarray(rows)
        cols = {k: v[index] for k, v in self.columns.items()}
        n = int(np.count_nonzero(index)) if index.dtype == bool else int(index.shape[0])
        return EncodedTable(self.schema, cols, n,
                            {k: m[index] for k, m in self.missing.items()})

    def to_frame(self) -> pd.DataFrame:
        """Decode to a DataFrame with the schema's types; missing values are NA.

        Continuous columns are floats (nullable Int64 for ``integer`` columns with missing
        values, int64 otherwise), date columns ``datetime64``, ordinal and nominal columns
        ordered or plain categoricals.
        """
        import pandas as pd

        data: dict[str, Any] = {}
        for col in self.schema.columns:
            values = self.columns[col.name]
            mask = self.missing.get(col.name)
            if isinstance(col, DateColumn):
                data[col.name] = decode_dates(col, values, mask)
            elif isinstance(col, ContinuousColumn):
                decoded = output_values(col, values)
                if mask is not None and mask.any():
                    if decoded.dtype == np.int64:
                        data[col.name] = pd.array(decoded, dtype="Int64")
                        data[col.name][mask] = pd.NA
                        continue
                    decoded = np.where(mask, np.nan, decoded)
                data[col.name] = decoded
            else:
                labels = col.levels if col.type == "ordinal" else col.categories
                codes = values if mask is None else np.where(mask, -1, values)
                data[col.name] = pd.Categorical.from_codes(
                    codes, categories=pd.Index(list(labels)), ordered=col.type == "ordinal"
                )
        return pd.DataFrame(data)

    @staticmethod
    def concatenate(parts: list[EncodedTable]) -> EncodedTable:
        """Stack encoded chunks of the same schema."""
        if not parts:
            raise DataError("no rows to concatenate")
        schema = parts[0].schema
        cols = {c.name: np.concatenate([p.columns[c.name] for p in parts]) for c in schema.columns}
        masked = {name for p in parts for name in p.missing}
        missing = {name: np.concatenate([p.missing_mask(name) for p in parts])
                   for name in schema.names if name in masked}
        return EncodedTable(schema, cols, sum(p.n_rows for p in parts), missing)


def output_values(column: ContinuousColumn, values: np.ndarray) -> np.ndarray:
    """Return a continuous column's decoded values as outputs hold them (int64 if integer)."""
    return np.asarray(values).astype(np.int64 if column.writes_int64 else np.float64,
                                     copy=False)


def decode_dates(column: DateColumn, values: np.ndarray,
                 missing: np.ndarray | None = None) -> np.ndarray:
    """Return a date column's unit counts as ``datetime64`` values, for outputs.

    The synthesizer's (or anyone's) values are rounded to whole units and clipped to the
    column's public bounds first, so every output date lies within them; NaN and the rows
    ``missing`` marks become NaT. Dates are ``datetime64[D]``, datetimes ``datetime64[s]``
    (UTC, without a time zone). Every output of dates -- DataFrames, Parquet, CSV -- comes
    from here.
    """
    v = np.clip(np.asarray(values, dtype=np.float64), column.min, column.max)
    out = dates.decode_dates(v, column.type, column.resolution)
    if missing is not None:
        out[missing] = np.datetime64("NaT")
    return out


def codes_with_missing(table: EncodedTable, column: Column) -> tuple[np.ndarray, int]:
    """Return ``(codes, n_levels)`` with *missing* as one more level, for histograms.

    Ordinal and nominal columns: codes ``0..M-1`` as encoded and ``M`` where the column is
    missing (``n_levels = M + 1`` when ``missing = "category"``, else ``M`` and no code is
    ``M``). The extra level is public (it exists for every ``"category"`` column whether or
    not a value is missing), so histograms over it keep the schema's fixed shape.
    """
    if isinstance(column, ContinuousColumn):
        raise DataError(f"column {column.name!r} is {column.type}; codes_with_missing takes "
                        "ordinal and nominal columns (use EncodedTable.missing_mask)")
    codes = table.columns[column.name]
    levels = column.n_levels if isinstance(column, OrdinalColumn) else column.n_categories
    if column.missing != "category":
        return codes, levels
    mask = table.missing.get(column.name)
    if mask is not None:
        codes = np.where(mask, levels, codes).astype(codes.dtype, copy=False)
    return codes, levels + 1


def _column_from(table: pa.Table | pa.RecordBatch, index: int) -> pa.Array:
    col = table.column(index)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return col


def _missing_mask(col: pa.Array, missing_values: tuple[str, ...]) -> np.ndarray:
    mask = col.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        stripped = pc.utf8_trim_whitespace(col)
        in_missing = pc.is_in(stripped, value_set=pa.array(list(missing_values), pa.string()))
        mask |= in_missing.fill_null(False).to_numpy(zero_copy_only=False)
    return np.asarray(mask, dtype=bool)


def _parse_floats(col: pa.Array, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (float values with NaN where missing/invalid, invalid mask)."""
    n = len(col)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col = pc.utf8_trim_whitespace(col)
        try:
            values = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            # Slow path for blocks with unparsable text: element-wise, unparsable -> NaN.
            import pandas as pd

            as_text = pd.Series(col.to_numpy(zero_copy_only=False), dtype="object")
            values = pd.to_numeric(as_text, errors="coerce").to_numpy(dtype=np.float64)
    elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_decimal(
            col.type):
        values = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
    elif pa.types.is_boolean(col.type) or pa.types.is_null(col.type):
        values = np.full(n, np.nan)
        invalid = ~missing & ~col.is_null().to_numpy(zero_copy_only=False)
        return values, invalid
    else:
        raise DataError(f"column type {col.type} cannot hold continuous values")
    values = np.asarray(values, dtype=np.float64)
    values = np.where(missing, np.nan, values)
    nan = np.isnan(values)
    invalid = (nan & ~missing) | np.isinf(values)
    # A literal "NaN" that slipped past missing_values counts as missing, not invalid.
    return values, invalid


def _clean_numbers(col: pa.Array, spec: ContinuousColumn) -> np.ndarray | None:
    """Return a typed numeric column as float64 if it needs no row policy at all, else None.

    The fast path of :func:`encode_table` for Parquet/SQL/typed-CSV float or integer columns:
    no nulls, and the minimum and maximum inside the schema bounds (NaN propagates through
    both and infinities lie outside finite bounds, so this one test also rules out missing
    and invalid values). Float64 without nulls is read without a copy.
    """
    if col.null_count or not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
        return None
    if len(col) == 0:
        return None
    values: np.ndarray = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    low, high = values.min(), values.max()
    if spec.min <= low and high <= spec.max:
        return values
    return None


def _labels_of(col: pa.Array) -> pa.Array:
    """Render a column's values as the strings matched against levels/categories."""
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return pc.utf8_trim_whitespace(col)
    if pa.types.is_floating(col.type):
        values = col.to_numpy(zero_copy_only=False)
        finite = values[np.isfinite(values)]
        if finite.size == 0 or np.all(finite == np.round(finite)):
            # pandas turns integer columns with gaps into floats: 2.0 must match level "2".
            return pc.cast(pc.cast(col, pa.int64(), safe=False), pa.string())
    return pc.cast(col, pa.string())


def frame_to_arrow(schema: Schema, table: pd.DataFrame, source: str = "data") -> pa.Table:
    """Convert a DataFrame's schema columns to an Arrow table (text for object columns)."""
    import pandas as pd

    missing_cols = [n for n in schema.names if n not in table.columns]
    if missing_cols:
        raise DataError(
            f"{source}: missing column(s) {missing_cols}; the schema needs {list(schema.names)}"
        )
    frame = table[list(schema.names)].copy()
    for name in frame.columns:
        dtype = frame[name].dtype
        if isinstance(dtype, pd.CategoricalDtype):
            if all(isinstance(c, str) for c in dtype.categories):
                # Arrow keeps it as dictionary<string> (nulls for missing), decoded and
                # matched vectorised below; the per-value map is ~10x slower.
                continue
            frame[name] = frame[name].astype("object")
        if frame[name].dtype == object:
            frame[name] = frame[name].map(lambda v: v if v is None or isinstance(v, str)
                                          else (None if isinstance(v, float) and np.isnan(v)
                                                else str(v)))
    return pa.Table.from_pandas(frame, preserve_index=False)


def encode_table(schema: Schema, table: pa.Table | pa.RecordBatch | pd.DataFrame, *,
                 policy: RowPolicy | None = None, row_offset: int = 0,
                 source: str = "data") -> tuple[EncodedTable, EncodingReport]:
    """Validate and encode ``table`` against ``schema``.

    Parameters
    ----------
    schema : Schema
        The public schema; only its columns are read (extra columns are ignored).
    table : pyarrow.Table, pyarrow.RecordBatch or pandas.DataFrame
        The rows. Values may be typed or text.
    policy : RowPolicy, optional
        How to handle missing, invalid and out-of-range values (default: drop, drop, clip).
    row_offset : int
        Index of the first row of ``table`` within its source, for error messages.
    source : str
        What to call the input in error messages (e.g. a file name).

    Returns
    -------
    (EncodedTable, EncodingReport)

    Raises
    ------
    DataError
        When a schema column is absent, or a row breaks a policy whose action is "error".
        Messages name the column and the 1-based data row, never the value.
    """
    policy = policy or RowPolicy()
    if not isinstance(table, (pa.Table, pa.RecordBatch)):
        table = frame_to_arrow(schema, table, source)
    present = set(table.schema.names)
    missing_cols = [n for n in schema.names if n not in present]
    if missing_cols:
        raise DataError(
            f"{source}: missing column(s) {missing_cols}; the schema needs {list(schema.names)}, "
            f"the data has {sorted(present)}"
        )
    # Column positions once: a lookup by name scans the fields (O(p^2) per chunk at p = 2000).
    positions: dict[str, int] = {}
    for i, name in enumerate(table.schema.names):
        positions.setdefault(name, i)
    n = table.num_rows
    report = EncodingReport(rows_read=n)
    row_missing = np.zeros(n, dtype=bool)  # missing in a column declared complete
    row_drop = np.zeros(n, dtype=bool)  # missing in a "drop-row" column
    row_invalid = np.zeros(n, dtype=bool)
    row_oor = np.zeros(n, dtype=bool)
    raw: dict[str, np.ndarray] = {}
    oor_masks: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    kept_missing: dict[str, np.ndarray] = {}  # "category" / "impute" columns: missing rows
    to_other: dict[str, np.ndarray] = {}
    for col in schema.columns:
        arr = _column_from(table, positions[col.name])
        if isinstance(col, ContinuousColumn) and not isinstance(col, DateColumn):
            clean = _clean_numbers(arr, col)
            if clean is not None:
                raw[col.name] = clean
                continue
        missing = _missing_mask(arr, schema.missing_values)
        if isinstance(col, ContinuousColumn):
            if isinstance(col, DateColumn):
                values, invalid = dates.arrow_to_units(_null_where(arr, missing), col.resolution)
                invalid &= ~missing
            else:
                values, invalid = _parse_floats(arr, missing)
            missing = missing | (np.isnan(values) & ~invalid)
            with np.errstate(invalid="ignore"):
                low = values < col.min
                high = values > col.max
            oor_masks[col.name] = (low, high)
            row_oor |= low | high
            report._count(col.name, "out_of_range", int(np.count_nonzero(low | high)))
            raw[col.name] = values
        else:
            labels = col.levels if col.type == "ordinal" else col.categories
            codes = pc.index_in(_labels_of(arr), value_set=pa.array(list(labels), pa.string()))
            code_np = codes.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)
            invalid = (code_np < 0) & ~missing
            if isinstance(col, NominalColumn) and col.other_code is not None and invalid.any():
                code_np[invalid] = col.other_code
                to_other[col.name] = invalid
                report._count(col.name, "other", int(np.count_nonzero(invalid)))
                invalid = np.zeros(n, dtype=bool)
            raw[col.name] = code_np
        report._count(col.name, "missing", int(np.count_nonzero(missing)))
        report._count(col.name, "invalid", int(np.count_nonzero(invalid)))
        if col.missing is None:
            row_missing |= missing
        elif col.missing == "drop-row":
            row_drop |= missing
        elif missing.any():
            kept_missing[col.name] = missing
        row_invalid |= invalid & ~missing

    def fail(mask: np.ndarray, what: str, flag: str) -> None:
        first = int(np.argmax(mask))
        cols = [c for c, counts in report.problems_by_column.items() if counts.get(what)]
        raise DataError(
            f"{source}: data row {row_offset + first + 1} has {what.replace('_', ' ')} values "
            f"(columns with such values: {cols}); set {flag} = \"drop\" to skip such rows"
        )

    if policy.missing == "error" and row_missing.any():
        first = int(np.argmax(row_missing))
        cols = [c.name for c in schema.columns if c.missing is None
                and report.problems_by_column.get(c.name, {}).get("missing")]
        raise DataError(
            f"{source}: data row {row_offset + first + 1} has missing values in column(s) "
            f"{cols}, which the schema declares complete; say in the schema what a missing "
            "value is -- missing = \"category\" (keep the row, missing is a value of its own), "
            "\"impute\" (with a public impute value) or \"drop-row\" -- or set on_missing = "
            "\"drop\" in site.toml to drop such rows")
    row_missing |= row_drop
    row_invalid &= ~row_missing
    if policy.invalid == "error" and row_invalid.any():
        fail(row_invalid, "invalid", "on_invalid")
    bad = row_missing | row_invalid
    row_oor &= ~bad
    if policy.out_of_range == "error" and row_oor.any():
        fail(row_oor, "out_of_range", "on_out_of_range")
    keep = ~bad
    if policy.out_of_range == "drop":
        keep &= ~row_oor
        report.dropped_out_of_range = int(np.count_nonzero(row_oor))
    report.dropped_missing = int(np.count_nonzero(row_missing))
    report.dropped_invalid = int(np.count_nonzero(row_invalid))
    out: dict[str, np.ndarray] = {}
    out_missing: dict[str, np.ndarray] = {}
    all_kept = bool(keep.all())
    for col in schema.columns:
        values = raw[col.name] if all_kept else raw[col.name][keep]
        if (isinstance(col, ContinuousColumn) and policy.out_of_range == "clip"
                and col.name in oor_masks):
            low, high = oor_masks[col.name]
            n_clip = int(np.count_nonzero((low | high) & keep))
            if n_clip:
                report.values_clipped += n_clip
                values = np.clip(values, col.min, col.max)
        if col.name in to_other:
            report.values_to_other += int(np.count_nonzero(to_other[col.name] & keep))
        mask = kept_missing.get(col.name)
        if mask is not None:
            mask = mask if all_kept else mask[keep]
            n_missing = int(np.count_nonzero(mask))
            if n_missing:
                values = _filled(col, values, mask)
                if col.missing == "category":
                    out_missing[col.name] = mask
                    report.values_missing_kept += n_missing
                else:
                    report.values_imputed += n_missing
        out[col.name] = np.ascontiguousarray(values)
    report.rows_kept = int(np.count_nonzero(keep))
    return EncodedTable(schema, out, report.rows_kept, out_missing), report


def _filled(col: Column, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Return ``values`` with the column's public fill value where ``mask`` is set (a copy)."""
    fill = col.fill_value if isinstance(col, ContinuousColumn) else col.fill_code
    return np.where(mask, fill, values).astype(values.dtype, copy=False)


def _null_where(col: pa.Array, mask: np.ndarray) -> pa.Array:
    """``col`` with nulls where ``mask`` is set (missing markers are not parsed as values)."""
    if not mask.any() or not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return col
    return pc.if_else(pa.array(mask), pa.scalar(None, col.type), col)
