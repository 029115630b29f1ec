"""Dates and datetimes as whole counts of a public resolution since 1970-01-01 (UTC).

A ``date`` or ``datetime`` column is held internally as an integer number of *units* since
the epoch -- days for a date; seconds, minutes, hours or days for a datetime (the column's
public ``resolution``) -- so every consumer treats it as a continuous integer column with
public bounds. This module converts in both directions: schema bounds and data values to
units (:func:`to_units`, :func:`arrow_to_units`), and units back to dates for outputs
(:func:`decode_dates`, :func:`from_units`; :func:`iso_text` for text files). Naive datetimes
are taken as UTC; aware ones are converted to UTC. Values are floored to the resolution
(10:59 at an hourly resolution is 10:00).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpfed.common.errors import SchemaError

DATE_TYPES: tuple[str, ...] = ("date", "datetime")
#: Seconds per unit, by resolution name.
RESOLUTIONS: dict[str, int] = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
#: The resolution of a column that does not name one.
DEFAULT_RESOLUTION: dict[str, str] = {"date": "day", "datetime": "second"}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: numpy unit of a decoded value, by resolution.
_NUMPY_UNIT: dict[str, str] = {"second": "s", "minute": "m", "hour": "h", "day": "D"}


def check_resolution(kind: str, resolution: Any, where: str) -> str:
    """Validate a column's resolution: ``day`` for dates, any of :data:`RESOLUTIONS` else."""
    allowed = ("day",) if kind == "date" else tuple(RESOLUTIONS)
    if resolution not in allowed:
        raise SchemaError(f"{where}: 'resolution' of a {kind} column must be one of "
                          f"{', '.join(allowed)}, got {resolution!r}")
    return str(resolution)


def parse_instant(value: Any, where: str) -> dt.datetime:
    """Read a TOML date / datetime or an ISO 8601 string as an aware UTC datetime."""
    if isinstance(value, str):
        try:
            value = (dt.date.fromisoformat(value) if len(value.strip()) == 10
                     else dt.datetime.fromisoformat(value))
        except ValueError:
            raise SchemaError(f"{where} must be an ISO 8601 date or datetime such as "
                              f"2020-01-31 or 2020-01-31T08:00:00, got {value!r}") from None
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC)
    raise SchemaError(f"{where} must be a date (2020-01-31) or datetime, got {value!r}")


def to_units(value: Any, resolution: str, where: str) -> float:
    """Return a date, datetime or ISO string as whole units since the epoch (floored)."""
    seconds = (parse_instant(value, where) - _EPOCH) // dt.timedelta(seconds=1)
    return float(seconds // RESOLUTIONS[resolution])


def from_units(units: float, kind: str, resolution: str) -> str:
    """Return the ISO 8601 text of a whole number of units (the inverse of :func:`to_units`)."""
    moment = _EPOCH + dt.timedelta(seconds=int(units) * RESOLUTIONS[resolution])
    if kind == "date":
        return moment.date().isoformat()
    return moment.replace(tzinfo=None).isoformat()


def arrow_to_units(col: pa.Array, resolution: str) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(units as float64 with NaN where null or unparsable, unparsable mask)``.

    Accepts Arrow date32/date64, timestamps of any unit (with or without a time zone) and
    text in ISO 8601 (``2020-01-31``, ``2020-01-31 08:00``, ``2020-01-31T08:00:00``). Numbers
    and anything else are unparsable (a day count stored as a number is ambiguous).
    """
    n = len(col)
    unparsable = np.zeros(n, dtype=bool)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col, unparsable = _parse_text(pc.utf8_trim_whitespace(col))
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("s"))
    if not pa.types.is_timestamp(col.type):
        unparsable = ~col.is_null().to_numpy(zero_copy_only=False)
        return np.full(n, np.nan), np.asarray(unparsable, dtype=bool)
    if col.type.tz is not None:  # the instant in UTC, as a naive timestamp
        col = pc.cast(col, pa.timestamp(col.type.unit, tz="UTC")).cast(
            pa.timestamp(col.type.unit))
    seconds = pc.cast(pc.cast(col, pa.timestamp("s"), safe=False), pa.int64())
    values = seconds.to_numpy(zero_copy_only=False).astype(np.float64)
    per_unit = RESOLUTIONS[resolution]
    if per_unit > 1:
        values = np.floor(values / per_unit)
    values[col.is_null().to_numpy(zero_copy_only=False)] = np.nan
    return values, unparsable


def _parse_text(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Parse ISO 8601 text to timestamp[s]; return it (null where unparsable) and that mask."""
    try:
        return pc.cast(col, pa.timestamp("s")), np.zeros(len(col), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    parsed: list[dt.datetime | None] = []
    bad = np.zeros(len(col), dtype=bool)
    for i, text in enumerate(col.to_pylist()):
        if text is None or text == "":
            parsed.append(None)
            continue
        try:
            parsed.append(parse_instant(text, "value").replace(tzinfo=None))
        except SchemaError:
            parsed.append(None)
            bad[i] = True
    return pa.array(parsed, pa.timestamp("s")), bad


def decode_dates(values: np.ndarray, kind: str, resolution: str) -> np.ndarray:
    """Return unit counts as ``datetime64`` (days for dates, the resolution for datetimes).

    Values are rounded to whole units first (a synthesizer may produce fractions); NaN
    becomes ``NaT``. Pair with :func:`dpfed.common.data.encoding.output_values` semantics:
    clip to the column bounds before calling when the values may lie outside them.
    """
    v = np.asarray(values, dtype=np.float64)
    out = np.full(v.shape, np.datetime64("NaT"), dtype=f"datetime64[{_NUMPY_UNIT[resolution]}]")
    finite = np.isfinite(v)
    out[finite] = np.rint(v[finite]).astype(np.int64)
    if kind == "date":
        return out.astype("datetime64[D]")
    return out.astype("datetime64[s]")


#: ISO 8601 form of a datetime in text outputs (``2020-01-31T08:00:00``).
ISO_DATETIME = "%Y-%m-%dT%H:%M:%S"


def iso_text(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Return an Arrow timestamp column as ISO 8601 text (nulls kept), for CSV outputs.

    Arrow's CSV writer puts a space between the date and the time; this writes the ``T``
    that ISO 8601 (and :func:`from_units`) uses. Dates (date32) need no conversion.
    """
    return pc.strftime(col, format=ISO_DATETIME)
