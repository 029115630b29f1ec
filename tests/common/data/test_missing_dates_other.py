"""Missing values as data, date columns and the ``other`` bucket: schema, encoding, decoding."""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpfed.common.data.data_sources import open_data_source, read_all, spec_from_path
from dpfed.common.data.dates import iso_text
from dpfed.common.data.encoding import (
    EncodedTable,
    RowPolicy,
    codes_with_missing,
    decode_dates,
    encode_table,
)
from dpfed.common.data.schema import DateColumn, NominalColumn, Schema
from dpfed.common.errors import DataError, SchemaError
from dpfed.common.pca.features import UnitBallMap, feature_affine, feature_names

#: A schema written before the missing/other/date keys existed, and its digest then (the
#: code before this change computed it); the keys' defaults must not change it.
LEGACY = """
name = "demo"
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 110
integer = true

[[columns]]
name = "severity"
type = "ordinal"
levels = ["mild", "moderate", "severe"]

[[columns]]
name = "ward"
type = "nominal"
categories = ["cardiology", "oncology", "surgery"]

[[columns]]
name = "bmi"
type = "continuous"
min = 10.5
max = 60
"""
LEGACY_DIGEST = "32f87bfef327487b5b387265642895339adde0ccf325bb034c8eb56aaebf927f"

SCHEMA = Schema.from_toml("""
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 100
missing = "category"

[[columns]]
name = "creatinine"
type = "continuous"
min = 0
max = 10
missing = "impute"
impute = 1.0

[[columns]]
name = "stage"
type = "ordinal"
levels = ["I", "II", "III", "IV"]
missing = "category"

[[columns]]
name = "ward"
type = "nominal"
categories = ["icu", "surgery"]
missing = "category"
other = true

[[columns]]
name = "sex"
type = "nominal"
categories = ["F", "M"]
missing = "drop-row"

[[columns]]
name = "admitted"
type = "date"
min = 2015-01-01
max = 2024-12-31
missing = "category"
""")

ROWS = pd.DataFrame({
    "age": ["50", "NA", "30", "", "70", "20"],
    "creatinine": ["1.2", "", "0.9", "3", "NA", "2"],
    "stage": ["I", "IV", "", "II", "III", "I"],
    "ward": ["icu", "cafeteria", "surgery", "", "icu", "icu"],
    "sex": ["F", "M", "F", "M", "", "F"],
    "admitted": ["2016-02-29", "2030-01-01", "", "2015-01-01", "2020-06-15", "not a date"],
})


def test_legacy_schema_digest_is_unchanged() -> None:
    schema = Schema.from_toml(LEGACY)
    assert schema.digest() == LEGACY_DIGEST
    assert all(c.missing is None for c in schema.columns)
    assert Schema.from_toml(schema.to_toml()).digest() == LEGACY_DIGEST


def test_new_keys_round_trip_and_change_the_digest() -> None:
    again = Schema.from_toml(SCHEMA.to_toml())
    assert again == SCHEMA and again.digest() == SCHEMA.digest()
    ward = SCHEMA.column("ward")
    assert isinstance(ward, NominalColumn) and ward.categories == ("icu", "surgery", "other")
    admitted = SCHEMA.column("admitted")
    assert isinstance(admitted, DateColumn) and admitted.iso(admitted.min) == "2015-01-01"
    assert admitted.max - admitted.min == (dt.date(2024, 12, 31) - dt.date(2015, 1, 1)).days
    plain = LEGACY.replace('levels = ["mild", "moderate", "severe"]',
                           'levels = ["mild", "moderate", "severe"]\nmissing = "category"')
    assert Schema.from_toml(plain).digest() != LEGACY_DIGEST


def test_datetime_resolution_and_string_bounds() -> None:
    schema = Schema.from_toml("""
[[columns]]
name = "t"
type = "datetime"
min = "2020-01-01T00:00:00"
max = 2020-01-02T00:00:00
resolution = "minute"
""")
    col = schema.column("t")
    assert isinstance(col, DateColumn) and col.max - col.min == 24 * 60
    assert Schema.from_toml(schema.to_toml()) == schema


@pytest.mark.parametrize("column, match", [
    ("type='continuous'\nmin=0\nmax=1\nmissing='sometimes'", "'missing' must be one of"),
    ("type='continuous'\nmin=0\nmax=1\nmissing='impute'", "needs a public 'impute' value"),
    ("type='continuous'\nmin=0\nmax=1\nimpute=0.5", "applies only with missing = \"impute\""),
    ("type='continuous'\nmin=0\nmax=1\nmissing='impute'\nimpute=2", "within the bounds"),
    ("type='ordinal'\nlevels=['a','b']\nmissing='impute'\nimpute='c'", "one of the levels"),
    ("type='nominal'\ncategories=['a','b']\nother='yes'", "'other' must be true or false"),
    ("type='ordinal'\nlevels=['a','b']\nother=true", "unknown key"),
    ("type='date'\nmin=2020-01-01", "date columns need 'max'"),
    ("type='date'\nmin=2020-01-01\nmax='31/12/2020'", "ISO 8601"),
    ("type='date'\nmin=2020-01-01\nmax=2019-01-01", "'min' must be < 'max'"),
    ("type='date'\nmin=2020-01-01\nmax=2021-01-01\nresolution='hour'", "must be one of day"),
    ("type='datetime'\nmin=2020-01-01\nmax=2021-01-01\nresolution='week'", "'resolution'"),
])
def test_bad_column_options_are_named(column: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match) as err:
        Schema.from_toml(f"[[columns]]\nname='x'\n{column}\n", "s.toml")
    assert "s.toml: columns[0] ('x')" in str(err.value)


def test_missing_modes_keep_impute_or_drop_and_count_everything() -> None:
    enc, report = encode_table(SCHEMA, ROWS)
    # Row 5 has sex missing ("drop-row"); row 6 an unparsable date (invalid): both dropped.
    assert (report.rows_read, report.rows_kept) == (6, 4)
    assert (report.dropped_missing, report.dropped_invalid) == (1, 1)
    assert report.values_imputed == 1  # creatinine of row 2 (row 5's was dropped)
    assert report.values_to_other == 1  # "cafeteria"
    assert report.values_clipped == 1  # 2030-01-01 into the bounds
    # Kept rows 1-4: age missing in 2 and 4, stage in 3, ward in 4, admitted in 3.
    assert report.values_missing_kept == 5
    np.testing.assert_array_equal(enc.missing_mask("age"), [False, True, False, True])
    np.testing.assert_array_equal(enc.missing_mask("creatinine"), [False] * 4)
    assert "creatinine" not in enc.missing and "sex" not in enc.missing
    np.testing.assert_array_equal(enc.columns["age"], [50, 50, 30, 50])  # the midpoint
    np.testing.assert_array_equal(enc.columns["creatinine"], [1.2, 1.0, 0.9, 3.0])
    assert list(enc.columns["ward"]) == [0, 2, 1, 0]  # "other" is 2; missing holds 0
    frame = enc.to_frame()
    assert frame["age"].isna().tolist() == [False, True, False, True]
    assert frame["ward"].astype(object).tolist()[:3] == ["icu", "other", "surgery"]
    assert pd.isna(frame["ward"].iloc[3])
    assert str(frame["admitted"].dtype) == "datetime64[s]"
    assert frame["admitted"].tolist()[0] == pd.Timestamp("2016-02-29")
    assert frame["admitted"].tolist()[1] == pd.Timestamp("2024-12-31")  # clipped
    assert pd.isna(frame["admitted"].iloc[2])
    codes, levels = codes_with_missing(enc, SCHEMA.column("stage"))
    assert levels == 5 and list(codes) == [0, 3, 4, 1]
    codes, levels = codes_with_missing(enc, SCHEMA.column("sex"))
    assert levels == 2


def test_declared_complete_columns_stop_by_default_and_drop_on_request() -> None:
    schema = Schema.from_toml(LEGACY)
    rows = pd.DataFrame({"age": [30, None, 50], "severity": ["mild"] * 3,
                         "ward": ["oncology"] * 3, "bmi": [20.0, 21.0, None]})
    with pytest.raises(DataError, match=r"data row 2 has missing values in column\(s\) "
                       r"\['age', 'bmi'\], which the schema declares complete"):
        encode_table(schema, rows)
    enc, report = encode_table(schema, rows, policy=RowPolicy(missing="drop"))
    assert (enc.n_rows, report.dropped_missing) == (1, 2)
    # A "drop-row" column drops whatever the site's on_missing says.
    drop_row = Schema.from_toml(LEGACY.replace("max = 110\n", "max = 110\nmissing = 'drop-row'\n")
                                .replace("max = 60\n", "max = 60\nmissing = 'drop-row'\n"))
    enc, report = encode_table(drop_row, rows, policy=RowPolicy(missing="error"))
    assert (enc.n_rows, report.dropped_missing) == (1, 2)


def test_other_bucket_only_when_allowed() -> None:
    schema = Schema((NominalColumn("ward", ("icu", "surgery")),))
    _, report = encode_table(schema, pd.DataFrame({"ward": ["icu", "zoo"]}))
    assert (report.rows_kept, report.dropped_invalid) == (1, 1)
    allowed = Schema((NominalColumn("ward", ("icu", "surgery", "other"), other=True),))
    enc, report = encode_table(allowed, pd.DataFrame({"ward": ["icu", "zoo", "other"]}))
    assert list(enc.columns["ward"]) == [0, 2, 2] and report.values_to_other == 1
    assert report.problems_by_column == {"ward": {"other": 1}}


def test_dates_from_every_arrow_type_agree() -> None:
    schema = Schema.from_toml("""
[[columns]]
name = "d"
type = "datetime"
min = 2000-01-01T00:00:00
max = 2030-01-01T00:00:00
resolution = "hour"
""")
    instants = [dt.datetime(2001, 3, 4, 10, 59), dt.datetime(2020, 1, 1, 0, 0)]
    expected = [(t - dt.datetime(1970, 1, 1)) // dt.timedelta(hours=1) for t in instants]
    variants = [
        pa.array([t.isoformat() for t in instants]),
        pa.array([t.isoformat(sep=" ", timespec="minutes") for t in instants]),
        pa.array(instants, pa.timestamp("ms")),
        pa.array([t.replace(tzinfo=dt.UTC) for t in instants], pa.timestamp("s", tz="UTC")),
        # The same instants an hour east of UTC.
        pa.array([(t + dt.timedelta(hours=1)).replace(tzinfo=dt.timezone(dt.timedelta(hours=1)))
                  for t in instants], pa.timestamp("us", tz="+01:00")),
    ]
    for arr in variants:
        enc, report = encode_table(schema, pa.table({"d": arr}), policy=RowPolicy())
        assert list(enc.columns["d"]) == expected, arr.type
    col = schema.column("d")
    assert isinstance(col, DateColumn)
    decoded = decode_dates(col, np.asarray(expected, dtype=float) + 0.3)
    assert decoded.tolist() == [dt.datetime(2001, 3, 4, 10), dt.datetime(2020, 1, 1)]
    day = Schema.from_toml("[[columns]]\nname='d'\ntype='date'\nmin=2000-01-01\nmax=2030-01-01")
    enc, _ = encode_table(day, pa.table({"d": pa.array([dt.date(2001, 3, 4)], pa.date32())}))
    assert enc.to_frame()["d"].tolist() == [pd.Timestamp("2001-03-04")]
    _, report = encode_table(day, pa.table({"d": pa.array([12.0, 3.0])}),
                             policy=RowPolicy())
    assert report.dropped_invalid == 2  # a number is not a date


def test_decoded_dates_are_rounded_clipped_and_nat_where_missing() -> None:
    schema = Schema.from_toml("""
[[columns]]
name = "seen"
type = "datetime"
min = 2020-01-01T00:00:00
max = 2020-03-01T00:00:00
resolution = "minute"
[[columns]]
name = "day"
type = "date"
min = 2015-01-01
max = 2024-12-31
""")
    seen, day = schema.column("seen"), schema.column("day")
    assert isinstance(seen, DateColumn) and isinstance(day, DateColumn)
    # Units: a value below the bounds, a fraction under half a unit, one over, NaN, above.
    units = np.array([seen.min - 1e6, seen.min + 10.4, seen.min + 10.6, np.nan, seen.max + 5])
    missing = np.array([False, False, False, False, True])
    out = decode_dates(seen, units, missing)
    assert out.dtype == np.dtype("datetime64[s]")
    assert out[:3].tolist() == [dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 1, 0, 10),
                                dt.datetime(2020, 1, 1, 0, 11)]
    assert np.isnat(out[3:]).all()  # NaN and the rows marked missing
    assert decode_dates(seen, units[4:])[0] == np.datetime64("2020-03-01T00:00:00")  # clipped
    days = decode_dates(day, np.array([day.max + 400.0, day.min - 3.0, day.min + 0.5, np.nan]))
    assert days.dtype == np.dtype("datetime64[D]")
    assert days[:3].tolist() == [dt.date(2024, 12, 31), dt.date(2015, 1, 1),
                                 dt.date(2015, 1, 1)]  # half a day rounds to even
    assert np.isnat(days[3])
    # Text outputs: ISO 8601 with the T, nulls kept.
    text = iso_text(pa.array(np.append(out[:2], np.datetime64("NaT"))))
    assert text.to_pylist() == ["2020-01-01T00:00:00", "2020-01-01T00:10:00", None]


def test_files_and_databases_agree_on_missing_dates_and_other(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    ROWS.to_csv(csv, index=False)
    pq.write_table(pa.Table.from_pandas(ROWS, preserve_index=False), tmp_path / "t.parquet")
    typed = ROWS.assign(admitted=pd.to_datetime(ROWS["admitted"], errors="coerce"))
    pq.write_table(pa.Table.from_pandas(typed, preserve_index=False), tmp_path / "typed.parquet")
    db = tmp_path / "t.db"
    with sqlite3.connect(db) as conn:
        ROWS.replace({"": None}).to_sql("t", conn, index=False)
    conn.close()
    results = [read_all(open_data_source(spec_from_path(p, **kw), SCHEMA)) for p, kw in (
        (csv, {}), (tmp_path / "t.parquet", {}), (db, {"table": "t"}))]
    for enc, report in results:
        pd.testing.assert_frame_equal(enc.to_frame(), results[0][0].to_frame())
        assert report.values_missing_kept == results[0][1].values_missing_kept == 5
    # Typed timestamps: the unparsable text became null, i.e. missing rather than invalid.
    enc, report = read_all(open_data_source(spec_from_path(tmp_path / "typed.parquet"), SCHEMA))
    assert (report.rows_kept, report.dropped_invalid) == (5, 0)


def test_concatenate_keeps_the_missing_masks() -> None:
    enc, _ = encode_table(SCHEMA, ROWS.iloc[:2])
    enc2, _ = encode_table(SCHEMA, ROWS.iloc[2:4])
    both = EncodedTable.concatenate([enc, enc2])
    np.testing.assert_array_equal(both.missing_mask("age"), [False, True, False, True])
    np.testing.assert_array_equal(both.missing_mask("stage"), [False, False, True, False])


def test_pca_features_carry_missing_indicators_inside_the_unit_ball() -> None:
    names = feature_names(SCHEMA)
    assert names == ("age", "age (missing)", "creatinine", "stage", "stage (missing)",
                     "ward=icu", "ward=surgery", "ward=other", "sex=F", "sex=M", "admitted",
                     "admitted (missing)")
    offset, scale = feature_affine(SCHEMA)
    assert offset.shape == scale.shape == (len(names),)
    enc, _ = encode_table(SCHEMA, ROWS)
    fmap = UnitBallMap(SCHEMA)
    u = fmap.scaled(enc)
    assert u.shape == (4, len(names))
    i = names.index
    np.testing.assert_array_equal(u[:, i("age (missing)")], [0, 1, 0, 1])
    np.testing.assert_array_equal(u[:, i("age")], [0.0, 0.0, -0.4, 0.0])
    np.testing.assert_array_equal(u[:, i("stage (missing)")], [0, 0, 1, 0])
    assert u[2, i("stage")] == 0.0  # missing: 0, not the middle level's -1/3
    np.testing.assert_array_equal(u[3, i("ward=icu"):i("ward=other") + 1], [0, 0, 0])
    assert np.max(np.linalg.norm(u, axis=1)) <= fmap.norm
    x, clipped = fmap.transform(enc)
    assert clipped == 0 and np.max(np.linalg.norm(x, axis=1)) <= 1.0


def test_extreme_rows_never_leave_the_unit_ball() -> None:
    # Every combination of extremes and missing values per column: a column's features
    # (value and indicator, or its one-hot) have norm at most 1.
    extremes = {
        "age": ["0", "100", ""], "creatinine": ["0", "10", ""], "stage": ["I", "IV", ""],
        "ward": ["icu", "other", "zzz", ""], "sex": ["F", "M"],
        "admitted": ["2015-01-01", "2024-12-31", ""],
    }
    grid = pd.MultiIndex.from_product(list(extremes.values()), names=list(extremes)).to_frame(
        index=False)
    enc, report = encode_table(SCHEMA, grid)
    assert report.rows_kept == len(grid)
    norms = np.linalg.norm(UnitBallMap(SCHEMA).scaled(enc), axis=1)
    assert norms.max() == pytest.approx(np.sqrt(len(SCHEMA.columns)))
