"""An OMOP CDM warehouse as a site's table: the schema's extraction run on PostgreSQL or DuckDB.

A site points ``data.path`` at a small ``<name>.omop.toml`` that says where its CDM lives::

    engine = "postgres"                 # or "duckdb"
    conninfo = "host=warehouse dbname=omop user=dpfed_reader sslmode=verify-full"
    password_env = "DPFED_PG_PASSWORD"  # or password_file = "pg_password" (or ~/.pgpass)
    # path = "cdm.duckdb"               # engine = "duckdb": the database file
    cdm_schema = "cdm"                  # the schema holding person, measurement, ...

What is extracted comes from the federation's schema (its ``[omop]`` table,
:mod:`dpfed.common.data.omop_extraction`), so every site computes the same features. The
query runs read-only and streamed by the PostgreSQL (:mod:`dpfed.common.data.postgres`) or
DuckDB (:mod:`dpfed.common.data.duckdb_source`) source, with the same validation and row
policy as any other source.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from dpfed.common.data.omop_extraction import check_cdm_schema, extraction_query
from dpfed.common.data.schema import Schema
from dpfed.common.data.source_base import DataSource, DataSourceSpec
from dpfed.common.errors import ConfigError, SchemaError

ENGINES: tuple[str, ...] = ("postgres", "duckdb")
_KEYS = {"engine", "path", "conninfo", "password_env", "password_file", "cdm_schema"}


def _descriptor(path: Path) -> dict[str, object]:
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"OMOP source file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read OMOP source file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(doc) - _KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    return doc


def _password(doc: dict[str, object], where: Path) -> str | None:
    env, file = doc.get("password_env"), doc.get("password_file")
    if env is not None and file is not None:
        raise ConfigError(f"{where}: give at most one of password_env and password_file")
    if isinstance(env, str):
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"{where}: password_env names {env!r}, which is not set")
        return value
    if isinstance(file, str):
        try:
            return (where.parent / file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"{where}: password_file {file}: cannot be read "
                              f"({exc.strerror})") from None
    return None


def inner_spec(spec: DataSourceSpec, schema: Schema) -> DataSourceSpec:
    """Return the PostgreSQL or DuckDB spec that runs ``schema``'s extraction for ``spec``.

    Raises
    ------
    ConfigError
        The descriptor is unreadable, names an unknown engine, or lacks what the engine needs.
    SchemaError
        The schema has no ``[omop]`` table.
    """
    where = spec.path
    assert where is not None
    if schema.omop is None:
        raise SchemaError(f"{where}: an OMOP source needs a schema with an [omop] table (how "
                          "each column is extracted from the CDM)")
    doc = _descriptor(where)
    engine = doc.get("engine")
    if engine not in ENGINES:
        raise ConfigError(f"{where}: 'engine' must be one of {', '.join(ENGINES)}, got "
                          f"{engine!r}")
    try:
        cdm = check_cdm_schema(doc.get("cdm_schema", "cdm"))
    except SchemaError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    query = extraction_query(schema.omop, cdm)
    if engine == "postgres":
        conninfo = doc.get("conninfo")
        if not isinstance(conninfo, str) or not conninfo or "path" in doc:
            raise ConfigError(f"{where}: engine = \"postgres\" needs conninfo (and no path)")
        return DataSourceSpec("postgres", None, query=query, chunk_rows=spec.chunk_rows,
                              policy=spec.policy, conninfo=conninfo,
                              password=_password(doc, where))
    db = doc.get("path")
    if not isinstance(db, str) or not db or {"conninfo", "password_env",
                                             "password_file"} & set(doc):
        raise ConfigError(f"{where}: engine = \"duckdb\" needs path (the database file) and "
                          "no conninfo or password")
    return DataSourceSpec("duckdb", where.parent / db, query=query, chunk_rows=spec.chunk_rows,
                          policy=spec.policy)


class OmopSource(DataSource):
    """The schema's extraction over one site's CDM (see the module docstring).

    ``inner`` is the opened PostgreSQL or DuckDB source of :func:`inner_spec` (opened by
    :func:`dpfed.common.data.data_sources.open_data_source`).
    """

    def __init__(self, spec: DataSourceSpec, schema: Schema, inner: DataSource) -> None:
        super().__init__(spec, schema)
        self.inner = inner

    def describe(self) -> str:
        """See :meth:`DataSource.describe`."""
        return f"OMOP extraction ({self.path.name}) from {self.inner.describe()}"

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        return self.inner._batches()

