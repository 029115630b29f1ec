"""The federation schema: the public description of every column, read from TOML.

One ``[[columns]]`` table per column, in data order::

    [[columns]]
    name = "age"
    type = "continuous"
    min = 0
    max = 110
    integer = true          # optional: whole numbers only (synthetic values are too)

    [[columns]]
    name = "severity"
    type = "ordinal"
    levels = ["mild", "moderate", "severe"]     # in order

    [[columns]]
    name = "ward"
    type = "nominal"
    categories = ["cardiology", "oncology", "surgery"]

    [[columns]]
    name = "admitted"
    type = "date"           # or "datetime" (with resolution = "second" | "minute" | "hour" | "day")
    min = 2015-01-01
    max = 2024-12-31

Every column may say what a missing value in it is (``missing``): ``"category"`` keeps the
row and makes *missing* a value of its own (a missing indicator for PCA, one more level of
the column's histogram), ``"drop-row"`` drops the row (counted and reported), ``"impute"``
replaces it with the public value ``impute``. A column without ``missing`` is declared
complete: a missing value in it follows the site's ``on_missing`` (``"error"`` by default: the
site stops and names the column, so no row is ever dropped silently). A nominal column with
``other = true`` maps values that are not among its categories to the category ``"other"``
instead of rejecting the row.

Optional top-level keys: ``name`` (a label), ``missing_values`` (the strings read as
missing; default ``["", "NA", "NaN", "nan", "null", "NULL"]``) and ``[omop]`` (how every column
is extracted from an OMOP CDM warehouse: :mod:`dpfed.common.data.omop_extraction`).

Bounds, levels and categories are *public*: they come from this file, never from the data
(docs/privacy.md, invariant 3). Every site and the coordinator check that they hold the same schema
by comparing :meth:`Schema.digest`.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dpfed.common.data import dates
from dpfed.common.data.omop_extraction import OmopExtraction, parse_extraction
from dpfed.common.errors import SchemaError

COLUMN_TYPES: tuple[str, ...] = ("continuous", "ordinal", "nominal", *dates.DATE_TYPES)
DEFAULT_MISSING_VALUES: tuple[str, ...] = ("", "NA", "NaN", "nan", "null", "NULL")
#: What a column does with a missing value (the ``missing`` key; None: declared complete).
MISSING_MODES: tuple[str, ...] = ("category", "drop-row", "impute")
#: The category a nominal column with ``other = true`` maps undeclared values to.
OTHER_CATEGORY = "other"


@dataclass(frozen=True)
class ContinuousColumn:
    """A real-valued column with declared bounds ``min <= x <= max``.

    ``integer``: the column's values are whole numbers (ages in years, counts, days), so
    synthetic values are whole numbers too (a public fact used only to decode outputs; data
    values are read as they are). Its bounds must then be whole numbers.
    ``missing``: one of :data:`MISSING_MODES` or None (declared complete: the site's row
    policy handles a missing value); ``impute``: the public value of ``"impute"``.
    """

    name: str
    min: float
    max: float
    type: str = "continuous"
    integer: bool = False
    missing: str | None = None
    impute: float | None = None
    #: Set only by :func:`dpfed.common.synth.missing_cells.cells_schema`: the synthesizer's
    #: cells of this column end with a *missing* cell (never read from a schema file).
    missing_cell: bool = False

    def __post_init__(self) -> None:
        if self.integer and not (float(self.min).is_integer() and float(self.max).is_integer()):
            raise SchemaError(f"integer column {self.name!r} needs whole-number bounds, got "
                              f"min={self.min:g}, max={self.max:g}")
        _check_missing(self.name, self.missing, self.impute)
        if self.impute is not None and not self.min <= self.impute <= self.max:
            raise SchemaError(f"column {self.name!r}: 'impute' must lie within the bounds "
                              f"[{self.min:g}, {self.max:g}], got {self.impute:g}")

    @property
    def fill_value(self) -> float:
        """The value held where this column is missing (``impute``, else the midpoint)."""
        return self.center if self.impute is None else self.impute

    @property
    def writes_int64(self) -> bool:
        """Whether outputs hold this column as 64-bit integers (integer, bounds within 2^53)."""
        return self.integer and -(2.0 ** 53) <= self.min and self.max <= 2.0 ** 53

    @property
    def center(self) -> float:
        """Midpoint of the declared bounds."""
        return (self.min + self.max) / 2.0

    @property
    def half_range(self) -> float:
        """Half the width of the declared bounds."""
        return (self.max - self.min) / 2.0


@dataclass(frozen=True)
class DateColumn(ContinuousColumn):
    """A date or datetime column, held as whole ``resolution`` units since 1970-01-01 UTC.

    ``min``, ``max`` and ``impute`` are unit counts (:func:`dpfed.common.data.dates.to_units`
    of the schema's dates), so every consumer of continuous columns treats it as an integer
    column with public bounds; outputs are decoded back to dates
    (:func:`dpfed.common.data.dates.decode_dates`).
    """

    type: str = "date"
    integer: bool = True
    resolution: str = "day"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.type not in dates.DATE_TYPES or not self.integer:
            raise SchemaError(f"column {self.name!r}: a DateColumn has type date or datetime "
                              "and integer units")
        dates.check_resolution(self.type, self.resolution, f"column {self.name!r}")

    def iso(self, units: float) -> str:
        """Return a unit count as ISO 8601 text (``2020-01-31`` or ``2020-01-31T08:00:00``)."""
        return dates.from_units(units, self.type, self.resolution)


@dataclass(frozen=True)
class OrdinalColumn:
    """An ordered categorical column; values are the strings in ``levels``, in order."""

    name: str
    levels: tuple[str, ...]
    type: Literal["ordinal"] = "ordinal"
    missing: str | None = None
    impute: str | None = None
    #: Set only by :func:`dpfed.common.synth.missing_cells.cells_schema`: the last level is
    #: the synthesizer's *missing* cell.
    missing_cell: bool = False

    def __post_init__(self) -> None:
        _check_missing(self.name, self.missing, self.impute)
        if self.impute is not None and self.impute not in self.levels:
            raise SchemaError(f"column {self.name!r}: 'impute' must be one of the levels "
                              f"{list(self.levels)}, got {self.impute!r}")

    @property
    def n_levels(self) -> int:
        """Number of levels M (codes are 0..M-1)."""
        return len(self.levels)

    @property
    def fill_code(self) -> int:
        """The code held where this column is missing (``impute``'s, else the middle level)."""
        return (self.n_levels - 1) // 2 if self.impute is None else self.levels.index(self.impute)


@dataclass(frozen=True)
class NominalColumn:
    """An unordered categorical column; values are the strings in ``categories``.

    With ``other`` the last category is :data:`OTHER_CATEGORY` (appended when the schema
    does not list it), and values outside the categories are read as it.
    """

    name: str
    categories: tuple[str, ...]
    type: Literal["nominal"] = "nominal"
    missing: str | None = None
    impute: str | None = None
    other: bool = False
    #: Set only by :func:`dpfed.common.synth.missing_cells.cells_schema`: the last category
    #: is the synthesizer's *missing* cell.
    missing_cell: bool = False

    def __post_init__(self) -> None:
        _check_missing(self.name, self.missing, self.impute)
        if self.other and OTHER_CATEGORY not in self.categories:
            object.__setattr__(self, "categories", (*self.categories, OTHER_CATEGORY))
        if self.impute is not None and self.impute not in self.categories:
            raise SchemaError(f"column {self.name!r}: 'impute' must be one of the categories "
                              f"{list(self.categories)}, got {self.impute!r}")

    @property
    def n_categories(self) -> int:
        """Number of categories Q (codes are 0..Q-1)."""
        return len(self.categories)

    @property
    def other_code(self) -> int | None:
        """The code undeclared values are read as (None without ``other``)."""
        return self.categories.index(OTHER_CATEGORY) if self.other else None

    @property
    def fill_code(self) -> int:
        """The code held where this column is missing (``impute``'s, else 0).

        Under ``missing = "category"`` consumers read :attr:`EncodedTable.missing`; the code
        only keeps every value a valid category for those that do not.
        """
        return 0 if self.impute is None else self.categories.index(self.impute)


Column = ContinuousColumn | OrdinalColumn | NominalColumn


def _check_missing(name: str, mode: str | None, impute: object) -> None:
    if mode is not None and mode not in MISSING_MODES:
        raise SchemaError(f"column {name!r}: 'missing' must be one of "
                          f"{', '.join(repr(m) for m in MISSING_MODES)}, got {mode!r}")
    if (impute is None) == (mode == "impute"):
        raise SchemaError(
            f"column {name!r}: " + ("missing = \"impute\" needs a public 'impute' value (dpfed "
                                    "never takes one from the data)"
                                    if impute is None else
                                    "'impute' applies only with missing = \"impute\""))


_MISSING_KEYS = {"missing", "impute"}
_ALLOWED_KEYS: dict[str, set[str]] = {
    "continuous": {"name", "type", "min", "max", "integer"} | _MISSING_KEYS,
    "ordinal": {"name", "type", "levels"} | _MISSING_KEYS,
    "nominal": {"name", "type", "categories", "other"} | _MISSING_KEYS,
    "date": {"name", "type", "min", "max", "resolution"} | _MISSING_KEYS,
    "datetime": {"name", "type", "min", "max", "resolution"} | _MISSING_KEYS,
}


def _label(value: Any) -> str:
    """Render a TOML level/category (string, int or float) as the string matched in data."""
    if isinstance(value, bool):
        raise TypeError("booleans are not valid labels")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str | int | float):
        return str(value)
    raise TypeError(f"labels must be strings or numbers, got {type(value).__name__}")


def _parse_column(index: int, table: Any, source: str) -> Column:
    where = f"{source}: columns[{index}]"
    if not isinstance(table, dict):
        raise SchemaError(f"{where} must be a table, got {type(table).__name__}")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SchemaError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    where = f"{source}: columns[{index}] ({name!r})"
    ctype = table.get("type")
    if ctype not in COLUMN_TYPES:
        raise SchemaError(
            f"{where}: 'type' must be one of {', '.join(COLUMN_TYPES)}, got {ctype!r}")
    unknown = set(table) - _ALLOWED_KEYS[ctype]
    if unknown:
        raise SchemaError(
            f"{where}: unknown key(s) {sorted(unknown)} for a {ctype} column; "
            f"allowed: {sorted(_ALLOWED_KEYS[ctype])}"
        )
    mode = table.get("missing")
    if mode is not None and mode not in MISSING_MODES:
        raise SchemaError(f"{where}: 'missing' must be one of "
                          f"{', '.join(repr(m) for m in MISSING_MODES)}, got {mode!r}")
    try:
        if ctype in dates.DATE_TYPES:
            return _parse_date(name, ctype, table, mode, where)
        if ctype == "continuous":
            return _parse_continuous(name, table, mode, where)
        return _parse_categorical(name, ctype, table, mode, where)
    except SchemaError as exc:
        text = str(exc)
        prefix = f"column {name!r}: "
        raise SchemaError(f"{where}: {text.removeprefix(prefix)}") from None


def _number(table: dict[str, Any], key: str, where: str) -> float:
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise SchemaError(f"{where}: '{key}' must be a finite number, got {v!r}")
    return float(v)


def _check_bounds(low: float, high: float, where: str) -> None:
    if not low < high:
        raise SchemaError(f"{where}: 'min' must be < 'max', got min={low:g}, max={high:g}")


def _parse_continuous(name: str, table: dict[str, Any], mode: str | None,
                      where: str) -> ContinuousColumn:
    bounds = {}
    for key in ("min", "max"):
        if key not in table:
            raise SchemaError(
                f"{where}: continuous columns need '{key}' (a public bound; dpfed never "
                "takes bounds from the data)"
            )
        bounds[key] = _number(table, key, where)
    _check_bounds(bounds["min"], bounds["max"], where)
    integer = table.get("integer", False)
    if not isinstance(integer, bool):
        raise SchemaError(f"{where}: 'integer' must be true or false, got {integer!r}")
    if integer and not (bounds["min"].is_integer() and bounds["max"].is_integer()):
        raise SchemaError(
            f"{where}: an integer column needs whole-number 'min' and 'max', got "
            f"min={bounds['min']:g}, max={bounds['max']:g}")
    impute = _number(table, "impute", where) if "impute" in table else None
    return ContinuousColumn(name, bounds["min"], bounds["max"], integer=integer, missing=mode,
                            impute=impute)


def _parse_date(name: str, ctype: str, table: dict[str, Any], mode: str | None,
                where: str) -> DateColumn:
    resolution = dates.check_resolution(
        ctype, table.get("resolution", dates.DEFAULT_RESOLUTION[ctype]), where)
    units = {}
    for key in ("min", "max", "impute"):
        if key in table:
            units[key] = dates.to_units(table[key], resolution, f"{where}: '{key}'")
        elif key != "impute":
            raise SchemaError(f"{where}: {ctype} columns need '{key}' (a public bound such as "
                              "2015-01-01; dpfed never takes bounds from the data)")
    _check_bounds(units["min"], units["max"], where)
    return DateColumn(name, units["min"], units["max"], type=ctype, missing=mode,
                      impute=units.get("impute"), resolution=resolution)


def _parse_categorical(name: str, ctype: str, table: dict[str, Any], mode: str | None,
                       where: str) -> Column:
    key = "levels" if ctype == "ordinal" else "categories"
    raw = table.get(key)
    if not isinstance(raw, list) or len(raw) < 2:
        raise SchemaError(f"{where}: '{key}' must be a list of at least 2 values, got {raw!r}")
    try:
        labels = tuple(_label(v) for v in raw)
        impute = _label(table["impute"]) if "impute" in table else None
    except TypeError as exc:
        raise SchemaError(f"{where}: '{key}': {exc}") from None
    if len(set(labels)) != len(labels):
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        raise SchemaError(f"{where}: '{key}' has duplicates: {dupes}")
    if ctype == "ordinal":
        return OrdinalColumn(name, labels, missing=mode, impute=impute)
    other = table.get("other", False)
    if not isinstance(other, bool):
        raise SchemaError(f"{where}: 'other' must be true or false, got {other!r}")
    return NominalColumn(name, labels, missing=mode, impute=impute, other=other)


def _column_dict(c: Column) -> dict[str, Any]:
    """Return one column as plain data, leaving out keys at their defaults.

    So the digest of a schema that does not use a key is what it was before the key existed.
    """
    entry: dict[str, Any] = {"name": c.name, "type": c.type}
    impute: Any = c.impute
    if isinstance(c, DateColumn):
        entry.update({"min": c.iso(c.min), "max": c.iso(c.max)})
        if c.resolution != dates.DEFAULT_RESOLUTION[c.type]:
            entry["resolution"] = c.resolution
        impute = None if c.impute is None else c.iso(c.impute)
    elif isinstance(c, ContinuousColumn):
        entry.update({"min": c.min, "max": c.max})
        if c.integer:
            entry["integer"] = True
    elif isinstance(c, OrdinalColumn):
        entry["levels"] = list(c.levels)
    else:
        entry["categories"] = list(c.categories)
        if c.other:
            entry["other"] = True
    if c.missing is not None:
        entry["missing"] = c.missing
    if impute is not None:
        entry["impute"] = impute
    if c.missing_cell:
        entry["missing_cell"] = True
    return entry


@dataclass(frozen=True)
class Schema:
    """An ordered set of typed columns (see the module docstring for the TOML format)."""

    columns: tuple[Column, ...]
    missing_values: tuple[str, ...] = DEFAULT_MISSING_VALUES
    name: str = ""
    omop: OmopExtraction | None = None

    def __post_init__(self) -> None:
        if not self.columns:
            raise SchemaError("a schema needs at least one [[columns]] table")
        names = [c.name for c in self.columns]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SchemaError(f"column names must be unique, duplicated: {dupes}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "schema") -> Schema:
        """Build a schema from a parsed TOML document (``source`` names it in errors)."""
        if not isinstance(data, dict):
            raise SchemaError(f"{source}: expected a table at top level")
        unknown = set(data) - {"columns", "missing_values", "name", "omop"}
        if unknown:
            raise SchemaError(
                f"{source}: unknown top-level key(s) {sorted(unknown)}; "
                "allowed: columns, missing_values, name, omop"
            )
        raw = data.get("columns")
        if not isinstance(raw, list) or not raw:
            raise SchemaError(f"{source}: needs at least one [[columns]] table")
        columns = tuple(_parse_column(i, t, source) for i, t in enumerate(raw))
        missing = data.get("missing_values", list(DEFAULT_MISSING_VALUES))
        if not isinstance(missing, list) or not all(isinstance(m, str) for m in missing):
            raise SchemaError(f"{source}: 'missing_values' must be a list of strings")
        name = data.get("name", "")
        if not isinstance(name, str):
            raise SchemaError(f"{source}: 'name' must be a string")
        omop = None
        if "omop" in data:
            omop = parse_extraction(data["omop"], {c.name: c.type for c in columns}, source)
        try:
            return cls(columns, tuple(missing), name, omop)
        except SchemaError as exc:
            raise SchemaError(f"{source}: {exc}") from None

    @classmethod
    def from_toml(cls, text: str, source: str = "schema") -> Schema:
        """Parse a schema from TOML text."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SchemaError(f"{source}: not valid TOML: {exc}") from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        """Read a schema TOML file."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SchemaError(f"schema file not found: {p}") from None
        except OSError as exc:
            raise SchemaError(f"cannot read schema file {p}: {exc.strerror}") from None
        return cls.from_toml(text, str(p))

    # ------------------------------------------------------------------ export
    def to_dict(self) -> dict[str, Any]:
        """Return the schema as plain data (the inverse of :meth:`from_dict`)."""
        cols = [_column_dict(c) for c in self.columns]
        out: dict[str, Any] = {"columns": cols, "missing_values": list(self.missing_values)}
        if self.name:
            out["name"] = self.name
        if self.omop is not None:
            out["omop"] = self.omop.to_dict()
        return out

    def to_toml(self) -> str:
        """Return the schema as TOML text that :meth:`from_toml` reads back identically."""
        lines: list[str] = []
        if self.name:
            lines.append(f"name = {json.dumps(self.name)}")
        lines.append("missing_values = " + json.dumps(list(self.missing_values)))
        for col in self.to_dict()["columns"]:
            lines.append("")
            lines.append("[[columns]]")
            for key, value in col.items():
                lines.append(f"{key} = {json.dumps(value)}")
        if self.omop is not None:
            omop = self.omop.to_dict()
            lines.extend(["", "[omop]"])
            if "cohort" in omop:
                lines.append(f"cohort = {json.dumps(omop['cohort'])}")
            for name, feature in omop["columns"].items():
                lines.extend(["", f"[omop.columns.{json.dumps(name)}]"])
                lines.extend(f"{key} = {json.dumps(value)}" for key, value in feature.items())
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        """Return the SHA-256 hex digest of the canonical schema (compared at connect time)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    # ------------------------------------------------------------------ access
    @property
    def names(self) -> tuple[str, ...]:
        """Column names in data order."""
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        """Return the column called ``name``."""
        for c in self.columns:
            if c.name == name:
                return c
        raise SchemaError(f"no column named {name!r}; columns are {list(self.names)}")

    def of_type(self, ctype: str) -> tuple[Column, ...]:
        """Return the columns of one type, in data order."""
        return tuple(c for c in self.columns if c.type == ctype)
