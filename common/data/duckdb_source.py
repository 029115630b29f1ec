"""Read a site's table from a DuckDB database file: a table, view or read-only query, streamed.

DuckDB (the optional extra ``dpfed[duckdb]``) is a common local copy of an OMOP CDM
warehouse. The database is attached ``READ_ONLY``, then external access is disabled and the
configuration locked, so a query can neither change the database nor read or write any other
file (``read_csv('/etc/...')``, ``ATTACH``, ``COPY ... TO``). Rows stream as Arrow batches of
``chunk_rows`` (``to_arrow_reader``), so the site never holds the result.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from dpfed.common.data.schema import Schema
from dpfed.common.data.source_base import (
    DataSource,
    DataSourceSpec,
    _check_readable_file,
    _quote_identifier,
)
from dpfed.common.errors import ConfigError, DataError

_CATALOG = "dpfed_source"


def _driver() -> Any:
    try:
        import duckdb
    except ImportError:
        raise ConfigError("a duckdb data source needs DuckDB: pip install 'dpfed[duckdb]'"
                          ) from None
    return duckdb


class DuckDBSource(DataSource):
    """A table, view or query in a DuckDB file, fetched ``chunk_rows`` at a time.

    Raises
    ------
    DataError
        The file is missing or not a DuckDB database, the table does not exist, or a schema
        column is missing.
    ConfigError
        DuckDB is not installed, or the query is invalid or does more than read.
    """

    def __init__(self, spec: DataSourceSpec, schema: Schema) -> None:
        super().__init__(spec, schema)
        self._duckdb = _driver()
        _check_readable_file(self.path, "database file")
        with self._connect() as conn:
            names = self._relation(conn, limit_zero=True).columns
        self._check_result_columns(list(names))

    def describe(self) -> str:
        """See :meth:`DataSource.describe`."""
        if self.spec.table is not None:
            return f"duckdb table {self.spec.table!r} in {self.path}"
        return f"duckdb query on {self.path}"

    def _connect(self) -> Any:
        # Attached under a fixed name rather than opened: DuckDB names an opened file's
        # catalog after the file, and "cdm.person" is ambiguous in cdm.duckdb.
        conn = self._duckdb.connect(":memory:")
        try:
            path = str(self.path.resolve()).replace("'", "''")
            conn.execute(f"ATTACH '{path}' AS {_CATALOG} (READ_ONLY)")
            conn.execute(f"USE {_CATALOG}")
            conn.execute("SET enable_external_access = false")
            conn.execute("SET lock_configuration = true")
        except self._duckdb.Error as exc:
            conn.close()
            raise DataError(f"cannot open {self.describe()} as a DuckDB database: "
                            f"{_first_line(exc)}") from None
        return conn

    def _relation(self, conn: Any, *, limit_zero: bool = False) -> Any:
        if self.spec.table is not None:
            table = ".".join(_quote_identifier(p) for p in self.spec.table.split("."))
            columns = "*" if limit_zero else ", ".join(_quote_identifier(n)
                                                       for n in self.schema.names)
            sql = f"SELECT {columns} FROM {table}"
        else:
            assert self.spec.query is not None
            sql = self.spec.query.strip().rstrip(";")
        if limit_zero:
            sql = f"SELECT * FROM ({sql}) AS dpfed_source LIMIT 0"
        try:
            return conn.sql(sql)
        except self._duckdb.Error as exc:
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> ConfigError | DataError:
        """Translate a DuckDB error (its messages name objects, never row values)."""
        duckdb = self._duckdb
        if isinstance(exc, duckdb.ConversionException | duckdb.OutOfRangeException):
            # Their messages quote the value that failed: name the kind of failure only.
            return DataError(f"{self.describe()}: a value could not be converted "
                             f"({type(exc).__name__}); check the query's casts")
        message = _first_line(exc)
        if isinstance(exc, duckdb.CatalogException):
            return DataError(f"{self.describe()}: {message}")
        if isinstance(exc, duckdb.ParserException | duckdb.BinderException):
            return ConfigError(f"{self.describe()}: invalid query: {message}")
        if isinstance(exc, duckdb.InvalidInputException | duckdb.PermissionException):
            return ConfigError(f"{self.describe()}: not allowed: {message}; the site only "
                               "reads its database (no writes, no other files)")
        return DataError(f"{self.describe()}: {message}")

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        names = list(self.schema.names)
        with self._connect() as conn:
            relation = self._relation(conn)
            try:
                reader = relation.to_arrow_reader(self.chunk_rows)
                indexes = [reader.schema.get_field_index(n) for n in names]
                for batch in reader:
                    if batch.num_rows:
                        yield pa.RecordBatch.from_arrays(
                            [batch.column(i) for i in indexes], names), 0
            except self._duckdb.Error as exc:
                raise self._error(exc) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
