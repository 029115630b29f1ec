"""Chunked data sources: formats agree, chunking is invisible, bad input gives clear errors."""

from __future__ import annotations

import gzip
import logging
import os
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from dpfed.common.data.data_sources import (
    MALFORMED_ROWS_KEY,
    CsvSource,
    DataSourceSpec,
    open_data_source,
    read_all,
    scan,
    spec_from_path,
)
from dpfed.common.data.encoding import EncodedTable, EncodingReport, RowPolicy
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ConfigError, DataError

SCHEMA = Schema((
    ContinuousColumn("age", 0, 110),
    ContinuousColumn("bmi", 10, 70),
    OrdinalColumn("severity", ("mild", "moderate", "severe")),
    NominalColumn("ward", ("icu", "surgery", "general")),
))
NUMERIC = Schema((ContinuousColumn("a", -100, 100), ContinuousColumn("b", -100, 100)))
#: The row policy that drops rows with a missing value in a column declared complete (the
#: default, "error", stops instead).
DROP = RowPolicy(missing="drop")
# A value that must never appear in an error message.
SECRET = "987654.321"


def clean_frame(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "patient_id": np.arange(n),  # extra column, ignored
        "age": np.round(rng.uniform(0, 110, n), 1),
        "bmi": np.round(rng.uniform(10, 70, n), 2),
        "severity": rng.choice(["mild", "moderate", "severe"], n),
        "ward": rng.choice(["icu", "surgery", "general"], n),
    })


def write_csv(path: Path, frame: pd.DataFrame, delimiter: str = ",") -> Path:
    pcsv.write_csv(pa.Table.from_pandas(frame, preserve_index=False), path,
                   write_options=pcsv.WriteOptions(delimiter=delimiter))
    return path


def write_sqlite(path: Path, frame: pd.DataFrame, table: str = "admissions") -> Path:
    with sqlite3.connect(path) as conn:
        frame.to_sql(table, conn, index=False)
    conn.close()
    return path


def csv_source(path: Path, schema: Schema = SCHEMA, **kwargs: object) -> CsvSource:
    source = open_data_source(spec_from_path(path, **kwargs), schema)  # type: ignore[arg-type]
    assert isinstance(source, CsvSource)
    return source


def frames_equal(a: EncodedTable, b: EncodedTable) -> None:
    pd.testing.assert_frame_equal(a.to_frame(), b.to_frame())


def report_counts(r: EncodingReport) -> tuple[object, ...]:
    by_column = {c: dict(sorted(v.items())) for c, v in sorted(r.problems_by_column.items())}
    return (r.rows_read, r.rows_kept, r.dropped_missing, r.dropped_invalid,
            r.dropped_out_of_range, r.values_clipped, by_column)


# ------------------------------------------------------------------------- formats agree
def test_every_format_yields_the_same_rows(tmp_path: Path) -> None:
    frame = clean_frame(500)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "d.parquet",
                   row_group_size=128)
    db = write_sqlite(tmp_path / "d.sqlite", frame)
    specs = [
        spec_from_path(write_csv(tmp_path / "d.csv", frame)),
        spec_from_path(write_csv(tmp_path / "d.tsv", frame, "\t")),
        spec_from_path(tmp_path / "d.parquet"),
        spec_from_path(db, table="admissions"),
        spec_from_path(db, query="SELECT * FROM admissions ORDER BY patient_id"),
    ]
    expected = frame[list(SCHEMA.names)].reset_index(drop=True)
    for spec in specs:
        table, report = read_all(open_data_source(spec, SCHEMA))
        got = table.to_frame()
        pd.testing.assert_series_equal(got["age"], expected["age"])
        pd.testing.assert_series_equal(got["bmi"], expected["bmi"])
        assert list(got["severity"].astype(str)) == list(expected["severity"])
        assert list(got["ward"].astype(str)) == list(expected["ward"])
        assert report.rows_read == report.rows_kept == 500, spec.kind


def test_formats_agree_on_problem_rows(tmp_path: Path) -> None:
    frame = pd.DataFrame({
        "age": ["50", "NA", "abc", "200", "", "30", "-5", "40"],
        "bmi": ["20", "25", "30", "35", "40", "NaN", "22", "33"],
        "severity": ["mild", "severe", "mild", "moderate", "mild", "mild", "mild", "critical"],
        "ward": ["icu", "icu", "surgery", "general", "icu", "icu", "surgery", "icu"],
    })
    db = write_sqlite(tmp_path / "p.db", frame)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "p.parquet")
    results = [read_all(open_data_source(spec, SCHEMA)) for spec in (
        spec_from_path(write_csv(tmp_path / "p.csv", frame), policy=DROP),
        spec_from_path(tmp_path / "p.parquet", policy=DROP),
        spec_from_path(db, table="admissions", policy=DROP),
    )]
    for table, report in results:
        frames_equal(table, results[0][0])
        assert report_counts(report) == report_counts(results[0][1])
    _, report = results[0]
    # NA and "" in age and NaN in bmi are missing; "abc" and "critical" invalid; 200 and -5
    # clipped into [0, 110].
    assert (report.rows_read, report.rows_kept) == (8, 3)
    assert (report.dropped_missing, report.dropped_invalid, report.values_clipped) == (3, 2, 2)


# ------------------------------------------------------------------------- chunking
@pytest.mark.parametrize("chunk_rows", [13, 64, 999, 1000, 100_000])
def test_chunk_size_does_not_change_results(tmp_path: Path, chunk_rows: int) -> None:
    frame = clean_frame(1000, seed=1).astype({"age": str})
    frame.loc[[10, 500, 999], "age"] = ["NA", "x1", "500"]  # missing, invalid, clipped
    csv = write_csv(tmp_path / "c.csv", frame)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "c.parquet",
                   row_group_size=97)
    db = write_sqlite(tmp_path / "c.sqlite", frame)
    for path, table in ((csv, None), (tmp_path / "c.parquet", None), (db, "admissions")):
        whole, whole_report = read_all(open_data_source(
            spec_from_path(path, table=table, policy=DROP), SCHEMA))
        source = open_data_source(spec_from_path(path, chunk_rows=chunk_rows, table=table,
                                                 policy=DROP), SCHEMA)
        chunks = list(source.iter_chunks())
        assert all(r.rows_read <= chunk_rows for _, r in chunks)
        assert sum(r.rows_read for _, r in chunks) == 1000
        if path.suffix != ".parquet":
            # One CSV block holds this small file; SQLite fetches chunk_rows rows at a time.
            # (Parquet chunks may also end at a row group: batches are never joined.)
            assert all(r.rows_read == chunk_rows for _, r in chunks[:-1])
        parts, report = read_all(source)
        frames_equal(parts, whole)
        assert report_counts(report) == report_counts(whole_report)
        assert (report.rows_read, report.rows_kept, report.dropped_missing,
                report.dropped_invalid, report.values_clipped) == (1000, 998, 1, 1, 1)


def test_typed_fast_path_falls_back_mid_file_without_changing_results(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    n = 3000
    a = np.round(rng.normal(0, 30, n), 3).astype(str).astype(object)
    b = np.round(rng.normal(0, 30, n), 3).astype(str).astype(object)
    a[2500] = "oops"  # a block late in the file fails float conversion
    b[2700] = " 12.5 "  # whitespace: only the text reader accepts it
    lines = ["a,b"] + [f"{x},{y}" for x, y in zip(a, b, strict=True)]
    lines.insert(100, "1,2,3")  # wrong field counts before and after the switch
    lines.insert(2900, "4")
    path = tmp_path / "f.csv"
    path.write_text("\n".join(lines) + "\n")
    results = []
    caplog.set_level(logging.INFO, logger="dpfed.common.data.data_sources")
    for fast in (True, False):
        for chunk_rows in (7, 1024):
            source = CsvSource(spec_from_path(path, chunk_rows=chunk_rows), NUMERIC,
                               typed_fast_path=fast)
            source.block_size = 4096  # many Arrow blocks
            results.append(read_all(source))
        switches = [r for r in caplog.records if "reading the rest as text" in r.getMessage()]
        assert len(switches) == (2 if fast else 0)
        caplog.clear()
    for table, report in results:
        frames_equal(table, results[0][0])
        assert report_counts(report) == report_counts(results[0][1])
        assert (report.rows_read, report.rows_kept, report.dropped_invalid) == (3002, 2999, 3)
        assert report.problems_by_column[MALFORMED_ROWS_KEY] == {"invalid": 2}
    assert results[0][0].columns["b"][2699] == 12.5


def test_scan_counts_without_keeping_rows(tmp_path: Path) -> None:
    frame = clean_frame(60).astype({"bmi": str})
    frame.loc[5, "bmi"] = "NA"
    path = write_csv(tmp_path / "s.csv", frame)
    source = open_data_source(spec_from_path(path, chunk_rows=1, policy=DROP), SCHEMA)
    report = scan(source)
    assert report_counts(report) == report_counts(read_all(source)[1])
    assert (report.rows_read, report.rows_kept, report.dropped_missing) == (60, 59, 1)
    assert len(list(source.iter_chunks())) == 60


# ------------------------------------------------------------------------- CSV row problems
def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


MALFORMED = ("a,b\n1,2\n3\n4,5,6\n7,8\n9,10,11,12\n")


def test_rows_with_wrong_field_counts_are_counted_and_dropped(tmp_path: Path) -> None:
    table, report = read_all(csv_source(write_text(tmp_path / "m.csv", MALFORMED), NUMERIC))
    assert list(table.columns["a"]) == [1.0, 7.0]
    assert (report.rows_read, report.rows_kept, report.dropped_invalid) == (5, 2, 3)
    assert report.problems_by_column == {MALFORMED_ROWS_KEY: {"invalid": 3}}


def test_wrong_field_count_is_an_error_with_its_row_number_when_asked(tmp_path: Path) -> None:
    path = write_text(tmp_path / "m.csv", f"a,b\n1,2\n{SECRET}\n")
    source = csv_source(path, NUMERIC, policy=RowPolicy(invalid="error"))
    with pytest.raises(DataError) as err:
        read_all(source)
    message = str(err.value)
    assert "row 3 of the file" in message and "1 fields" in message and "has 2" in message
    assert str(path) in message and SECRET not in message


def test_missing_values_follow_the_policy(tmp_path: Path) -> None:
    path = write_text(tmp_path / "n.csv", "a,b\n1,2\nNA,3\n,4\nNaN,5\nnull,6\n7,8\n")
    _, report = read_all(csv_source(path, NUMERIC, policy=DROP))
    assert (report.rows_kept, report.dropped_missing) == (2, 4)
    assert report.problems_by_column == {"a": {"missing": 4}}
    # The default stops: no row is dropped unless the site or the schema says so.
    for policy in (RowPolicy(), RowPolicy(missing="error")):
        with pytest.raises(DataError, match=r"data row 2 has missing values .*\['a'\], which "
                           r"the schema declares complete.*missing = \"category\""):
            read_all(csv_source(path, NUMERIC, policy=policy))


def test_unparsable_numbers_and_unknown_categories_are_invalid(tmp_path: Path) -> None:
    path = write_text(tmp_path / "i.csv",
                      "age,bmi,severity,ward\n"
                      "50,20,mild,icu\n"
                      f"{SECRET}x,20,mild,icu\n"
                      "50,inf,mild,icu\n"
                      "50,20,catastrophic,icu\n"
                      "50,20,mild,cafeteria\n"
                      "1e3x,20,mild,icu\n")
    table, report = read_all(csv_source(path))
    assert (report.rows_kept, report.dropped_invalid) == (1, 5)
    assert {c: v["invalid"] for c, v in report.problems_by_column.items()} == {
        "age": 2, "bmi": 1, "severity": 1, "ward": 1}
    with pytest.raises(DataError) as err:
        read_all(csv_source(path, policy=RowPolicy(invalid="error")))
    assert "data row 2 has invalid values" in str(err.value)
    assert "'age'" in str(err.value) and SECRET not in str(err.value)


@pytest.mark.parametrize(("action", "kept", "clipped", "dropped"),
                         [("clip", 4, 2, 0), ("drop", 2, 0, 2)])
def test_out_of_range_values_follow_the_policy(tmp_path: Path, action: str, kept: int,
                                                clipped: int, dropped: int) -> None:
    path = write_text(tmp_path / "r.csv", "a,b\n1,2\n-101,0\n3,100.5\n100,-100\n")
    table, report = read_all(csv_source(path, NUMERIC, policy=RowPolicy(out_of_range=action)))
    assert (report.rows_kept, report.values_clipped, report.dropped_out_of_range) == (
        kept, clipped, dropped)
    assert table.columns["a"].min() >= -100 and table.columns["b"].max() <= 100


def test_out_of_range_error_names_column_and_row_not_value(tmp_path: Path) -> None:
    path = write_text(tmp_path / "r.csv", f"a,b\n1,2\n3,{SECRET}\n")
    with pytest.raises(DataError) as err:
        read_all(csv_source(path, NUMERIC, policy=RowPolicy(out_of_range="error")))
    assert "data row 2" in str(err.value) and "'b'" in str(err.value)
    assert SECRET not in str(err.value)


# ------------------------------------------------------------------------- CSV file problems
def test_missing_header_column_names_it_and_lists_the_header(tmp_path: Path) -> None:
    path = write_text(tmp_path / "h.csv", "age,severity,ward,extra\n50,mild,icu,1\n")
    with pytest.raises(DataError) as err:
        csv_source(path)
    message = str(err.value)
    assert "['bmi']" in message and "['age', 'severity', 'ward', 'extra']" in message
    assert str(path) in message


def test_header_names_are_stripped_and_quotes_and_bom_handled(tmp_path: Path) -> None:
    path = tmp_path / "q.csv"
    path.write_bytes(b'\xef\xbb\xbf a ,"b"\n1,2\n')
    table, _ = read_all(csv_source(path, NUMERIC))
    assert list(table.columns["a"]) == [1.0]


def test_wrong_delimiter_is_named(tmp_path: Path) -> None:
    path = write_text(tmp_path / "d.csv", "a;b\n1;2\n")
    with pytest.raises(DataError, match=r"is the delimiter right\?"):
        csv_source(path, NUMERIC)
    table, _ = read_all(csv_source(path, NUMERIC, delimiter=";"))
    assert list(table.columns["b"]) == [2.0]


def test_duplicate_schema_column_in_header_is_an_error(tmp_path: Path) -> None:
    path = write_text(tmp_path / "dup.csv", "a,b,a\n1,2,3\n")
    with pytest.raises(DataError, match=r"\['a'\] more than once"):
        csv_source(path, NUMERIC)


def test_non_utf8_data_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "u.csv"
    path.write_bytes(b"a,b\n1,2\n3,\xff\xfe\n")
    with pytest.raises(DataError) as err:
        csv_source(path, NUMERIC)
    assert str(path) in str(err.value) and "line 3 is not valid utf-8" in str(err.value)
    # Beyond the header sample, the error comes from the reader and names the column.
    big = tmp_path / "big.csv"
    big.write_bytes(b"a,b\n" + b"1,2\n" * 300_000 + b"3,\xff\n")
    source = csv_source(big, NUMERIC)
    with pytest.raises(DataError) as err:
        read_all(source)
    assert str(big) in str(err.value) and "not valid UTF-8 in column 'b'" in str(err.value)


def test_other_encodings_can_be_declared(tmp_path: Path) -> None:
    schema = Schema((NominalColumn("ward", ("café", "icu")),))
    path = tmp_path / "l.csv"
    path.write_bytes("ward\ncafé\nicu\n".encode("latin-1"))
    with pytest.raises(DataError, match="not valid utf-8"):
        csv_source(path, schema)
    table, _ = read_all(csv_source(path, schema, encoding="latin-1"))
    assert list(table.columns["ward"]) == [0, 1]


@pytest.mark.parametrize(("content", "match"), [
    (b"", "the file is empty"),
    (b"\n\n", "the file is empty"),
    (b"a,b\n", "has a header row but no data rows"),
    (b"a,b", "has a header row but no data rows"),
    (b"a,b\n\n\n", "has a header row but no data rows"),
])
def test_empty_and_header_only_files(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "e.csv"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as err:
        csv_source(path, NUMERIC)
    assert str(path) in str(err.value)


def test_missing_file_directory_and_unreadable_file(tmp_path: Path) -> None:
    for kind, name, extra in (("csv", "x.csv", {}), ("parquet", "x.parquet", {}),
                              ("sqlite", "x.db", {"table": "t"})):
        missing = tmp_path / name
        with pytest.raises(DataError, match=f"not found: {missing}"):
            open_data_source(DataSourceSpec(kind, missing, **extra), NUMERIC)  # type: ignore[arg-type]
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    with pytest.raises(DataError, match=f"{folder} is a directory"):
        csv_source(folder, NUMERIC)
    locked = write_text(tmp_path / "locked.csv", "a,b\n1,2\n")
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):
            pytest.skip("running as a user who can read any file")
        with pytest.raises(DataError, match=f"{locked} is not readable"):
            csv_source(locked, NUMERIC)
    finally:
        locked.chmod(0o600)


def test_row_longer_than_a_read_block_is_a_clear_error(tmp_path: Path) -> None:
    path = write_text(tmp_path / "long.csv", "a,b\n1,2\n3," + "4" * 300 + "\n5,6\n")
    source = csv_source(path, NUMERIC)
    source.block_size = 64  # normally >= 1 MiB and 4x the longest sampled line
    with pytest.raises(DataError, match=r"a row after data row 1 is longer than the read "
                                        r"block \(64 bytes\)") as err:
        read_all(source)
    assert "4" * 10 not in str(err.value)


def test_compressed_csv_is_streamed(tmp_path: Path) -> None:
    path = tmp_path / "z.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("a,b\n1,2\n3,4\n")
    table, _ = read_all(csv_source(path, NUMERIC))
    assert list(table.columns["a"]) == [1.0, 3.0]


def test_describe_names_kind_and_path_only(tmp_path: Path) -> None:
    path = write_text(tmp_path / "a.csv", f"a,b\n{SECRET},2\n")
    assert csv_source(path, NUMERIC).describe() == f"csv file {path}"


# ------------------------------------------------------------------------- Parquet
def test_parquet_missing_column_empty_file_and_garbage(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"a": [1.0], "c": [2.0]}), path)
    with pytest.raises(DataError, match=r"no column\(s\) \['b'\].*\['a', 'c'\]"):
        open_data_source(spec_from_path(path), NUMERIC)
    empty = tmp_path / "e.parquet"
    pq.write_table(pa.table({"a": pa.array([], pa.float64()), "b": pa.array([], pa.float64())}),
                   empty)
    with pytest.raises(DataError, match=f"parquet file {empty}: contains no data rows"):
        read_all(open_data_source(spec_from_path(empty), NUMERIC))
    garbage = write_text(tmp_path / "g.parquet", "a,b\n1,2\n")
    with pytest.raises(DataError, match=f"parquet file {garbage}: not a readable Parquet"):
        open_data_source(spec_from_path(garbage), NUMERIC)


# ------------------------------------------------------------------------- SQLite
@pytest.mark.parametrize("table", ["admissions; DROP TABLE x", "1abc", "a-b", 'a"b', ""])
def test_sqlite_table_must_be_an_identifier(tmp_path: Path, table: str) -> None:
    with pytest.raises(ConfigError, match="plain identifier"):
        spec_from_path(tmp_path / "d.db", table=table)


@pytest.mark.parametrize("query", [
    "DELETE FROM admissions",
    "  -- comment\n DROP TABLE admissions",
    "SELECT * FROM admissions; DROP TABLE admissions",
    "PRAGMA table_info(admissions)",
    "",
])
def test_sqlite_query_must_be_one_select(tmp_path: Path, query: str) -> None:
    with pytest.raises(ConfigError, match="sqlite query must be"):
        spec_from_path(tmp_path / "d.db", query=query)


def test_sqlite_query_cannot_write_even_inside_with(tmp_path: Path) -> None:
    db = write_sqlite(tmp_path / "d.db", clean_frame(5))
    spec = spec_from_path(db, query="WITH x AS (SELECT 1) DELETE FROM admissions")
    with pytest.raises(ConfigError, match="only SELECT/WITH queries are allowed"):
        open_data_source(spec, SCHEMA)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM admissions").fetchone() == (5,)
    conn.close()


def test_sqlite_query_with_semicolon_inside_a_string_is_one_statement(tmp_path: Path) -> None:
    db = write_sqlite(tmp_path / "d.db", clean_frame(6))
    spec = spec_from_path(db, query="SELECT * FROM admissions WHERE ward != 'a;b';")
    table, _ = read_all(open_data_source(spec, SCHEMA))
    assert table.n_rows == 6


def test_sqlite_missing_table_and_missing_column(tmp_path: Path) -> None:
    db = write_sqlite(tmp_path / "d.db", clean_frame(5))
    with pytest.raises(DataError, match=r"'patients' in .*no such table.*\['admissions'\]"):
        open_data_source(spec_from_path(db, table="patients"), SCHEMA)
    with pytest.raises(DataError, match=r"no column\(s\) \['bmi', 'ward'\]"):
        open_data_source(spec_from_path(db, query="SELECT age, severity FROM admissions"),
                         SCHEMA)
    with pytest.raises(DataError, match="no such table"):
        open_data_source(spec_from_path(db, query="SELECT * FROM nowhere"), SCHEMA)


def test_sqlite_spec_needs_table_or_query_and_file_must_be_a_database(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one of 'table' or 'query', got neither"):
        spec_from_path(tmp_path / "d.sqlite")
    with pytest.raises(ConfigError, match="got both"):
        spec_from_path(tmp_path / "d.sqlite", table="t", query="SELECT 1")
    fake = write_text(tmp_path / "fake.db", "a,b\n" * 100)
    with pytest.raises(DataError, match=f"{fake}.*cannot be read as an SQLite database"):
        open_data_source(spec_from_path(fake, table="t"), NUMERIC)


def test_sqlite_mixed_type_columns_follow_the_policy(tmp_path: Path) -> None:
    db = tmp_path / "mixed.db"
    with sqlite3.connect(db) as conn:
        conn.execute('CREATE TABLE t ("a" ANY, "b" ANY, "level" ANY)')
        conn.executemany("INSERT INTO t VALUES (?, ?, ?)", [
            (1.5, 2, 1), ("NA", 3, 2.0), ("x", 4, "2"), (0.1, None, 1), (7, 8, 3),
            (b"2.5", 1, 1),
        ])
    conn.close()
    schema = Schema((*NUMERIC.columns, OrdinalColumn("level", ("1", "2"))))
    table, report = read_all(open_data_source(spec_from_path(db, table="t", chunk_rows=2,
                                                             policy=DROP), schema))
    assert list(table.columns["a"]) == [1.5, 2.5]
    assert list(table.columns["level"]) == [0, 0]
    # Rows 2 and 4 missing; row 3 invalid "x"; row 5 level 3 unknown.
    assert (report.rows_read, report.dropped_missing, report.dropped_invalid) == (6, 2, 2)


# ------------------------------------------------------------------------- specs
def test_spec_from_path_infers_the_kind(tmp_path: Path) -> None:
    assert spec_from_path("x.csv").kind == "csv"
    assert spec_from_path("x.TSV").delimiter == "\t"
    assert spec_from_path("x.csv.gz").kind == "csv"
    assert spec_from_path("x.pq").kind == "parquet"
    assert spec_from_path("x.sqlite3", table="t").kind == "sqlite"
    for bad in ("x.xlsx", "x", "x.parquet.gz"):
        with pytest.raises(ConfigError, match="cannot tell the format"):
            spec_from_path(bad)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kind": "excel"}, "kind must be one of"),
    ({"chunk_rows": 0}, "chunk_rows must be an integer >= 1, got 0"),
    ({"chunk_rows": 2.5}, "chunk_rows must be an integer"),
    ({"delimiter": ",,"}, "delimiter must be one character"),
    ({"delimiter": '"'}, "delimiter must be one character"),
    ({"encoding": "no-such-codec"}, "encoding must be a Python codec"),
    ({"table": "t"}, "apply only to sqlite"),
    ({"path": ""}, "non-empty path"),
])
def test_spec_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"kind": "csv", "path": "x.csv", **kwargs}
    with pytest.raises(ConfigError, match=match):
        DataSourceSpec(**args)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- wide tables
def test_wide_csv_blocks_are_sized_by_bytes_per_row_and_never_joined(tmp_path: Path) -> None:
    p, n = 300, 3000
    wide = Schema(tuple(ContinuousColumn(f"x{j}", -10, 10) for j in range(p)))
    values = np.round(np.random.default_rng(3).uniform(-10, 10, (n, p)), 3)
    path = tmp_path / "wide.csv"
    np.savetxt(path, values, delimiter=",", fmt="%.3f",
               header=",".join(wide.names), comments="")
    per_row = path.stat().st_size / (n + 1)
    source = open_data_source(spec_from_path(path, chunk_rows=2000), wide)
    assert isinstance(source, CsvSource)
    # ~1024 rows a block (a 1 MiB block held ~470 of these rows), never joined into chunks.
    assert 1.0 <= source.block_size / (per_row * 1024) <= 1.2
    chunks = [t for t, _ in source.iter_chunks()]
    assert sum(t.n_rows for t in chunks) == n
    assert all(900 <= t.n_rows <= 1100 for t in chunks[:-1])
    # No block below 1 MiB, whatever chunk_rows asks for.
    narrow = open_data_source(spec_from_path(path, chunk_rows=10), wide)
    assert isinstance(narrow, CsvSource) and narrow.block_size == 1 << 20
    np.testing.assert_allclose(np.concatenate([t.columns["x7"] for t in chunks]), values[:, 7])


def test_wide_tables_get_fewer_rows_per_chunk(tmp_path: Path) -> None:
    def rows_per_chunk(p: int, chunk_rows: int) -> int:
        schema = Schema(tuple(ContinuousColumn(f"x{j}", 0, 1) for j in range(p)))
        path = tmp_path / f"w{p}.parquet"
        pq.write_table(pa.table({n: [0.5] for n in schema.names}), path)
        return open_data_source(spec_from_path(path, chunk_rows=chunk_rows), schema).chunk_rows

    # A chunk's float64 matrix is one p x p matrix, within [16 MiB, 128 MiB].
    assert rows_per_chunk(20, 65536) == 65536
    assert rows_per_chunk(50, 65536) == (16 << 20) // (8 * 50)
    assert rows_per_chunk(1000, 65536) == (16 << 20) // (8 * 1000)
    assert rows_per_chunk(2000, 65536) == 2000
    # 3355 rows at p = 5000, not 65536 (2.4 GiB).
    assert rows_per_chunk(5000, 65536) == (128 << 20) // (8 * 5000)
    assert rows_per_chunk(5000, 100) == 100
