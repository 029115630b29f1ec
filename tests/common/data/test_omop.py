"""OMOP CDM extraction: the schema's [omop] table, DuckDB and a real PostgreSQL server.

The extraction SQL is checked against an independent pandas computation on the generated
CDM tables, and both engines must return the same table for the same CDM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, read_all, spec_from_path
from dpfed.common.data.duckdb_source import DuckDBSource
from dpfed.common.data.omop_synthetic import (
    DEMO_SCHEMA,
    HBA1C,
    T2D,
    generate_cdm,
    write_duckdb,
    write_postgres,
)
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError, DataError, SchemaError
from tests.postgres_server import PostgresServer, start

SCHEMA = Schema.from_toml(DEMO_SCHEMA)
PERSONS = 1500


@pytest.fixture(scope="module")
def cdm() -> dict[str, pd.DataFrame]:
    return {name: t.to_pandas() for name, t in generate_cdm(PERSONS, seed=5, site=1).items()}


@pytest.fixture(scope="module")
def duck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("duck")
    write_duckdb(generate_cdm(PERSONS, seed=5, site=1), folder / "cdm.duckdb")
    (folder / "site.omop.toml").write_text('engine = "duckdb"\npath = "cdm.duckdb"\n')
    return folder / "site.omop.toml"


def test_generated_cdm_has_real_shapes(cdm: dict[str, pd.DataFrame]) -> None:
    per_person = cdm["condition_occurrence"].groupby("person_id").size()
    assert per_person.mean() > 5 and per_person.max() > 5 * per_person.median()  # skewed
    labs = cdm["measurement"]
    has_hba1c = labs[labs.measurement_concept_id == HBA1C].person_id.nunique() / PERSONS
    assert 0.1 < has_hba1c < 0.6  # most persons never have one: a missing feature
    assert labs.value_as_number.isna().mean() > 0  # recorded without a value
    assert (cdm["observation_period"].groupby("person_id").size() > 1).any()
    again = generate_cdm(PERSONS, seed=5, site=1)["measurement"].to_pandas()
    pd.testing.assert_frame_equal(again, labs)  # seeded


def expected_features(cdm: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """A few features computed independently of the SQL."""
    op = cdm["observation_period"]
    index = op.groupby("person_id").observation_period_end_date.max().rename("index_date")
    person = cdm["person"].set_index("person_id").join(index)
    out = pd.DataFrame(index=person.index)
    out["age"] = pd.to_datetime(person.index_date).dt.year - person.year_of_birth
    cond = cdm["condition_occurrence"].join(index, on="person_id")
    cond = cond[cond.condition_start_date <= cond.index_date]
    t2d = cond[cond.condition_concept_id == T2D]
    out["type2_diabetes"] = out.index.isin(t2d.person_id).astype(int)
    first = t2d.groupby("person_id").condition_start_date.min()
    out["days_since_diabetes"] = (pd.to_datetime(person.index_date)
                                  - pd.to_datetime(first.reindex(out.index))).dt.days
    labs = cdm["measurement"].join(index, on="person_id")
    lab = labs[(labs.measurement_concept_id == HBA1C) & labs.value_as_number.notna()
               & (labs.measurement_date <= labs.index_date)
               & (pd.to_datetime(labs.measurement_date)
                  >= pd.to_datetime(labs.index_date) - pd.Timedelta(days=730))]
    last = lab.sort_values(["measurement_date", "measurement_id"]).groupby("person_id").last()
    out["hba1c"] = last.value_as_number.reindex(out.index)
    return out.sort_index()


def test_duckdb_extraction_matches_an_independent_computation(
        duck: Path, cdm: dict[str, pd.DataFrame]) -> None:
    source = open_data_source(spec_from_path(duck, chunk_rows=400), SCHEMA)
    assert "OMOP extraction (site.omop.toml) from duckdb query" in source.describe()
    chunks = list(source.iter_chunks())
    assert len(chunks) == 4 and all(r.rows_read <= 400 for _, r in chunks)
    table, report = read_all(source)
    assert report.rows_read == report.rows_kept == PERSONS
    got = table.to_frame()
    want = expected_features(cdm)
    np.testing.assert_array_equal(got["age"].to_numpy(), want["age"].clip(18, 110).to_numpy())
    assert got["type2_diabetes"].astype(int).tolist() == want["type2_diabetes"].tolist()
    np.testing.assert_array_equal(got["days_since_diabetes"].isna(),
                                  want["days_since_diabetes"].isna())
    present = want["days_since_diabetes"].notna().to_numpy()
    np.testing.assert_array_equal(got["days_since_diabetes"].to_numpy()[present],
                                  want["days_since_diabetes"].to_numpy()[present])
    np.testing.assert_allclose(got["hba1c"].to_numpy(dtype=float),
                               want["hba1c"].clip(3, 15).to_numpy(), equal_nan=True)
    assert got["hba1c"].isna().mean() > 0.3  # missing, kept as data
    assert str(got["index_date"].dtype).startswith("datetime64")


def test_duckdb_is_read_only_and_reads_no_other_file(duck: Path, tmp_path: Path) -> None:
    db = duck.parent / "cdm.duckdb"
    schema = Schema.from_toml("[[columns]]\nname='x'\ntype='continuous'\nmin=0\nmax=1e9")
    for query, match in (
            ("SELECT * FROM read_csv('/etc/passwd') AS x", "not allowed"),
            ("SELECT person_id AS x FROM cdm.nowhere", "nowhere"),
            ("SELECT person_id AS x FROM cdm.person WHERE", "invalid query")):
        with pytest.raises((ConfigError, DataError), match=match):
            read_all(DuckDBSource(spec_from_path(db, query=query), schema))
    with pytest.raises(ConfigError, match="single read-only SELECT"):
        spec_from_path(db, query="COPY cdm.person TO '/tmp/out.csv'")
    before = db.stat().st_mtime_ns
    table, _ = read_all(open_data_source(spec_from_path(db, table="cdm.person"),
                                         Schema.from_toml("[[columns]]\nname='person_id'\n"
                                                          "type='continuous'\nmin=0\n"
                                                          "max=1e9")))
    assert table.n_rows == PERSONS and db.stat().st_mtime_ns == before


@pytest.mark.parametrize("extra, match", [
    ("[omop.columns.age]\ntable='person'\nfield='height'", "'field' of person"),
    ("[omop.columns.age]\ntable='visit'\nfield='x'", "'table' must be one of"),
    ("[omop.columns.age]\ntable='measurement'\nconcept_ids=[]\nvalue='last'", "concept_ids"),
    ("[omop.columns.age]\ntable='measurement'\nconcept_ids=[1]\nvalue='median'", "'value'"),
    ("[omop.columns.age]\ntable='cohort'\nfield='index_date'", "must be of type date"),
    ("[omop.columns.d]\ntable='person'\nfield='age'", "not schema columns: \\['d'\\]"),
])
def test_bad_extractions_are_named(extra: str, match: str) -> None:
    text = DEMO_SCHEMA.replace('[omop.columns.age]\ntable = "person"\nfield = "age"\n', "")
    with pytest.raises(SchemaError, match=match):
        Schema.from_toml(text + "\n" + extra + "\n", "s.toml")


def test_descriptor_errors(tmp_path: Path) -> None:
    for text, match in (('engine = "oracle"', "'engine' must be one of"),
                        ('engine = "duckdb"', "needs path"),
                        ('engine = "postgres"\npath = "x"', "needs conninfo"),
                        ('engine = "duckdb"\npath = "x.duckdb"\ncdm_schema = "a;b"',
                         "plain identifier"),
                        ('engine = "duckdb"\nport = 1', "unknown key")):
        (tmp_path / "s.omop.toml").write_text(text)
        with pytest.raises(ConfigError, match=match):
            open_data_source(spec_from_path(tmp_path / "s.omop.toml"), SCHEMA)
    with pytest.raises(SchemaError, match=r"needs a schema with an \[omop\] table"):
        open_data_source(spec_from_path(tmp_path / "s.omop.toml"),
                         Schema.from_toml("[[columns]]\nname='x'\ntype='continuous'\n"
                                          "min=0\nmax=1"))


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    srv, why = start()
    if srv is None:
        pytest.skip(f"no PostgreSQL server could start: {why}")
    try:
        with psycopg.connect(srv.admin_conninfo(), autocommit=True) as conn:
            conn.execute("CREATE ROLE omop_reader LOGIN PASSWORD 'omop-reader-pw'")
        write_postgres(generate_cdm(PERSONS, seed=5, site=1), srv.admin_conninfo(),
                       reader="omop_reader")
        yield srv
    finally:
        srv.stop()


def test_postgres_and_duckdb_extract_the_same_table(server: PostgresServer, duck: Path,
                                                    tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("omop-reader-pw\n")
    descriptor = tmp_path / "pg.omop.toml"
    descriptor.write_text(f'engine = "postgres"\nconninfo = '
                          f'"{server.tcp_conninfo("omop_reader")}"\npassword_file = "pw"\n')
    pg_source = open_data_source(spec_from_path(descriptor, chunk_rows=300), SCHEMA)
    assert "postgres query" in pg_source.describe()
    pg, pg_report = read_all(pg_source)
    dk, dk_report = read_all(open_data_source(spec_from_path(duck), SCHEMA))
    pd.testing.assert_frame_equal(pg.to_frame(), dk.to_frame())
    assert pg_report == dk_report
