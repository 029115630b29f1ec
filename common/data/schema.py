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

Optional top-level keys: ``name`` (a label) and ``missing_values`` (the strings read as
missing; default ``["", "NA", "NaN", "nan", "null", "NULL"]``).

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

from dpfed.common.errors import SchemaError

COLUMN_TYPES: tuple[str, ...] = ("continuous", "ordinal", "nominal")
DEFAULT_MISSING_VALUES: tuple[str, ...] = ("", "NA", "NaN", "nan", "null", "NULL")


@dataclass(frozen=True)
class ContinuousColumn:
    """A real-valued column with declared bounds ``min <= x <= max``.

    ``integer``: the column's values are whole numbers (ages in years, counts, days), so
    synthetic values are whole numbers too (a public fact used only to decode outputs; data
    values are read as they are). Its bounds must then be whole numbers.
    """

    name: str
    min: float
    max: float
    type: Literal["continuous"] = "continuous"
    integer: bool = False

    def __post_init__(self) -> None:
        if self.integer and not (float(self.min).is_integer() and float(self.max).is_integer()):
            raise SchemaError(f"integer column {self.name!r} needs whole-number bounds, got "
                              f"min={self.min:g}, max={self.max:g}")

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
class OrdinalColumn:
    """An ordered categorical column; values are the strings in ``levels``, in order."""

    name: str
    levels: tuple[str, ...]
    type: Literal["ordinal"] = "ordinal"

    @property
    def n_levels(self) -> int:
        """Number of levels M (codes are 0..M-1)."""
        return len(self.levels)


@dataclass(frozen=True)
class NominalColumn:
    """An unordered categorical column; values are the strings in ``categories``."""

    name: str
    categories: tuple[str, ...]
    type: Literal["nominal"] = "nominal"

    @property
    def n_categories(self) -> int:
        """Number of categories Q (codes are 0..Q-1)."""
        return len(self.categories)


Column = ContinuousColumn | OrdinalColumn | NominalColumn

_ALLOWED_KEYS: dict[str, set[str]] = {
    "continuous": {"name", "type", "min", "max", "integer"},
    "ordinal": {"name", "type", "levels"},
    "nominal": {"name", "type", "categories"},
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
    if ctype == "continuous":
        bounds = {}
        for key in ("min", "max"):
            if key not in table:
                raise SchemaError(
                    f"{where}: continuous columns need '{key}' (a public bound; dpfed never "
                    "takes bounds from the data)"
                )
            v = table[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise SchemaError(f"{where}: '{key}' must be a finite number, got {v!r}")
            bounds[key] = float(v)
        if not bounds["min"] < bounds["max"]:
            raise SchemaError(
                f"{where}: 'min' must be < 'max', got min={bounds['min']:g}, max={bounds['max']:g}"
            )
        integer = table.get("integer", False)
        if not isinstance(integer, bool):
            raise SchemaError(f"{where}: 'integer' must be true or false, got {integer!r}")
        if integer and not (bounds["min"].is_integer() and bounds["max"].is_integer()):
            raise SchemaError(
                f"{where}: an integer column needs whole-number 'min' and 'max', got "
                f"min={bounds['min']:g}, max={bounds['max']:g}")
        return ContinuousColumn(name, bounds["min"], bounds["max"], integer=integer)
    key = "levels" if ctype == "ordinal" else "categories"
    raw = table.get(key)
    if not isinstance(raw, list) or len(raw) < 2:
        raise SchemaError(f"{where}: '{key}' must be a list of at least 2 values, got {raw!r}")
    try:
        labels = tuple(_label(v) for v in raw)
    except TypeError as exc:
        raise SchemaError(f"{where}: '{key}': {exc}") from None
    if len(set(labels)) != len(labels):
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        raise SchemaError(f"{where}: '{key}' has duplicates: {dupes}")
    if ctype == "ordinal":
        return OrdinalColumn(name, labels)
    return NominalColumn(name, labels)


@dataclass(frozen=True)
class Schema:
    """An ordered set of typed columns (see the module docstring for the TOML format)."""

    columns: tuple[Column, ...]
    missing_values: tuple[str, ...] = DEFAULT_MISSING_VALUES
    name: str = ""

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
        unknown = set(data) - {"columns", "missing_values", "name"}
        if unknown:
            raise SchemaError(
                f"{source}: unknown top-level key(s) {sorted(unknown)}; "
                "allowed: columns, missing_values, name"
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
        try:
            return cls(columns, tuple(missing), name)
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
        cols: list[dict[str, Any]] = []
        for c in self.columns:
            if isinstance(c, ContinuousColumn):
                entry: dict[str, Any] = {"name": c.name, "type": c.type, "min": c.min,
                                         "max": c.max}
                if c.integer:  # only when set: schemas without it keep their digest
                    entry["integer"] = True
                cols.append(entry)
            elif isinstance(c, OrdinalColumn):
                cols.append({"name": c.name, "type": c.type, "levels": list(c.levels)})
            else:
                cols.append({"name": c.name, "type": c.type, "categories": list(c.categories)})
        out: dict[str, Any] = {"columns": cols, "missing_values": list(self.missing_values)}
        if self.name:
            out["name"] = self.name
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
