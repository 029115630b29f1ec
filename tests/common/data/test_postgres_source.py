"""PostgreSQL data source against a real server that the tests start (tests/postgres_server.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpfed.common.data.data_sources import (
    DataSourceSpec,
    open_data_source,
    read_all,
    spec_from_path,
)
from dpfed.common.data.encoding import RowPolicy
from dpfed.common.errors import ConfigError, DataError
from dpfed.common.transport.protocol import Task
from dpfed.site_agent.cli import data_spec
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.handlers.base import site_release
from tests.common.data.test_data_sources import SCHEMA, SECRET, clean_frame, frames_equal, write_csv
from tests.postgres_server import PostgresServer, start
from tests.support.tables import cost_of

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed "
                              "(pip install 'dpfed[postgres]')")

READER, READER_PASSWORD = "dpfed_reader", "reader-pw-7f3a"
N_ROWS = 1000


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    srv, why = start()
    if srv is None:
        pytest.skip(f"no PostgreSQL server could start: {why}")
    try:
        frame = clean_frame(N_ROWS, seed=4)
        with psycopg.connect(srv.admin_conninfo(), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {READER} LOGIN PASSWORD '{READER_PASSWORD}'")
            conn.execute("CREATE SCHEMA cdm")
            for table in ("admissions", "cdm.features"):
                # numeric (Decimal in Python) and double precision, text categories.
                conn.execute(f"CREATE TABLE {table} (patient_id bigint, age numeric(5,1), "
                             "bmi double precision, severity text, ward text)")
                with conn.cursor() as cur, cur.copy(
                        f"COPY {table} (patient_id, age, bmi, severity, ward) FROM STDIN") as cp:
                    for row in frame.itertuples(index=False):
                        cp.write_row(tuple(row))
            conn.execute("CREATE TABLE lacking (age double precision)")
            conn.execute("CREATE SEQUENCE counter")
            conn.execute("CREATE TABLE secret_rows (age text, bmi double precision, "
                         "severity text, ward text)")
            conn.execute(f"INSERT INTO secret_rows VALUES ('{SECRET}x', 20, 'mild', 'icu'), "
                         "(NULL, 25, 'severe', 'ward 9'), ('130', 30, 'moderate', 'surgery')")
            conn.execute(f"GRANT USAGE ON SCHEMA cdm TO {READER}")
            conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public, cdm TO {READER}")
        yield srv
    finally:
        srv.stop()


def pg_spec(server: PostgresServer, **kwargs: object) -> DataSourceSpec:
    kwargs.setdefault("password", READER_PASSWORD)
    return DataSourceSpec("postgres", None, conninfo=server.tcp_conninfo(READER),
                          **kwargs)  # type: ignore[arg-type]


def test_table_streams_in_chunks_and_matches_the_csv(server: PostgresServer,
                                                     tmp_path: Path) -> None:
    csv = write_csv(tmp_path / "same.csv", clean_frame(N_ROWS, seed=4))
    expected, expected_report = read_all(open_data_source(spec_from_path(csv), SCHEMA))
    source = open_data_source(pg_spec(server, table="admissions", chunk_rows=128), SCHEMA)
    assert source.describe() == (f"postgres table 'admissions' in postgres on "
                                 f"127.0.0.1:{server.port} as {READER}")
    chunks = list(source.iter_chunks())
    assert [r.rows_read for _, r in chunks] == [128] * 7 + [N_ROWS - 7 * 128]
    table, report = read_all(source)
    frames_equal(table, expected)
    assert (report.rows_read, report.rows_kept) == (expected_report.rows_read, N_ROWS)


def test_schema_qualified_table_and_query(server: PostgresServer) -> None:
    by_table, _ = read_all(open_data_source(pg_spec(server, table="cdm.features"), SCHEMA))
    query = ("-- adults only\nSELECT ward, severity, bmi, age FROM cdm.features "
             "WHERE age >= 18 ORDER BY patient_id;")
    by_query, report = read_all(open_data_source(pg_spec(server, query=query), SCHEMA))
    adults = by_table.columns["age"] >= 18
    assert report.rows_kept == int(adults.sum())
    np.testing.assert_array_equal(by_query.columns["bmi"], by_table.columns["bmi"][adults])


def test_row_policy_applies_as_for_files(server: PostgresServer) -> None:
    table, report = read_all(open_data_source(
        pg_spec(server, table="secret_rows", policy=RowPolicy(missing="drop")), SCHEMA))
    # Row 1 invalid age, row 2 missing age (and an unknown ward), row 3 age clipped to 110.
    assert (report.rows_read, report.rows_kept, report.dropped_invalid,
            report.dropped_missing, report.values_clipped) == (3, 1, 1, 1, 1)
    assert table.columns["age"].tolist() == [110.0]
    strict = pg_spec(server, table="secret_rows",
                     policy=RowPolicy(missing="drop", invalid="error"))
    with pytest.raises(DataError, match="data row 1 has invalid values") as err:
        read_all(open_data_source(strict, SCHEMA))
    assert SECRET not in str(err.value)


def test_start_up_errors_name_the_problem(server: PostgresServer) -> None:
    with pytest.raises(DataError, match=r"no column\(s\) \['bmi', 'severity', 'ward'\]"):
        open_data_source(pg_spec(server, table="lacking"), SCHEMA)
    with pytest.raises(DataError, match="no such table or view"):
        open_data_source(pg_spec(server, table="nowhere"), SCHEMA)
    with pytest.raises(DataError, match="cannot connect to postgres") as err:
        open_data_source(pg_spec(server, table="admissions", password="wrong-pw-123"), SCHEMA)
    assert "wrong-pw-123" not in str(err.value)
    with pytest.raises(ConfigError, match="invalid query"):
        open_data_source(pg_spec(server, query="SELECT age bmi FROM WHERE"), SCHEMA)


def test_the_session_is_read_only_whatever_the_role_may_do(server: PostgresServer) -> None:
    # The administrator may write, but a data source never does: its transactions are READ
    # ONLY, so a data-modifying CTE (which passes the SELECT/WITH check) is refused.
    writes = DataSourceSpec("postgres", None, conninfo=server.admin_conninfo(),
                            query="SELECT *, nextval('counter') FROM admissions")
    with pytest.raises(ConfigError, match="not allowed: cannot execute nextval"):
        read_all(open_data_source(writes, SCHEMA))
    deletes = DataSourceSpec("postgres", None, conninfo=server.admin_conninfo(),
                             query="WITH gone AS (DELETE FROM admissions RETURNING *) "
                                   "SELECT * FROM gone")
    with pytest.raises(DataError, match="data-modifying"):
        open_data_source(deletes, SCHEMA)
    with psycopg.connect(server.admin_conninfo()) as conn:
        assert conn.execute("SELECT count(*) FROM admissions").fetchone() == (N_ROWS,)
    with pytest.raises(ConfigError, match="single read-only SELECT"):
        pg_spec(server, query="DELETE FROM admissions")
    with pytest.raises(ConfigError, match="schema.table"):
        pg_spec(server, table="cdm.features; DROP TABLE x")


def _site_toml(tmp_path: Path, server: PostgresServer, extra: str) -> Path:
    schema = tmp_path / "schema.toml"
    schema.write_text(SCHEMA.to_toml())
    path = tmp_path / "site.toml"
    path.write_text(f"""
[coordinator]
address = "127.0.0.1:1"
[tls]
insecure = true
[data]
format = "postgres"
schema = "schema.toml"
conninfo = "{server.tcp_conninfo(READER)}"
table = "admissions"
{extra}
[budget]
epsilon = 10.0
delta = 1e-5
""")
    return path


def test_site_config_reads_the_password_from_env_or_file(
        server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPFED_TEST_PG_PASSWORD", READER_PASSWORD)
    config = load_site_config(_site_toml(tmp_path, server,
                                         'password_env = "DPFED_TEST_PG_PASSWORD"'))
    spec = data_spec(config)
    assert READER_PASSWORD not in repr(spec) and READER_PASSWORD not in repr(config)
    source = open_data_source(spec, SCHEMA)
    # The site's PCA task runs on it like on a file.
    task = Task("j/pca", "j", "pca", 1.0, 1e-5,
                {"n_components": 2, "centering": "none", "clip_norm": "schema"})
    prepared = site_release(task, source)
    assert math.isclose(cost_of(prepared).epsilon, 1.0)
    secret = tmp_path / "pg_password"
    secret.write_text(READER_PASSWORD + "\n")
    secret.chmod(0o600)
    config = load_site_config(_site_toml(tmp_path, server, 'password_file = "pg_password"'))
    assert read_all(open_data_source(data_spec(config), SCHEMA))[1].rows_kept == N_ROWS
    monkeypatch.delenv("DPFED_TEST_PG_PASSWORD")
    config = load_site_config(_site_toml(tmp_path, server,
                                         'password_env = "DPFED_TEST_PG_PASSWORD"'))
    with pytest.raises(ConfigError, match="'DPFED_TEST_PG_PASSWORD', which is not set"):
        data_spec(config)


@pytest.mark.parametrize("conninfo", ["host=db user=u password=hunter2",
                                      "postgresql://u:hunter2@db/omop",
                                      "postgresql://u@db/omop?password=hunter2"])
def test_site_config_refuses_a_plain_text_password(tmp_path: Path, conninfo: str) -> None:
    schema = tmp_path / "schema.toml"
    schema.write_text(SCHEMA.to_toml())
    path = tmp_path / "site.toml"
    path.write_text(f"""
[coordinator]
address = "127.0.0.1:1"
[tls]
insecure = true
[data]
format = "postgres"
schema = "schema.toml"
conninfo = "{conninfo}"
table = "admissions"
[budget]
epsilon = 10.0
delta = 1e-5
""")
    with pytest.raises(ConfigError, match="password in plain text") as err:
        load_site_config(path)
    assert "hunter2" not in str(err.value)
