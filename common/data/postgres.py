"""Read a site's table from PostgreSQL: a table, view or read-only query, streamed in chunks.

Hospital warehouses and OMOP CDM views usually live in PostgreSQL. The source connects with
psycopg 3 (the optional extra ``dpfed[postgres]``), checks at start-up that the table or
query has every schema column, and streams rows through a *server-side* cursor,
``chunk_rows`` at a time, so neither the site nor the driver ever holds the whole table. Every
session is ``READ ONLY`` (a query cannot change the database even if the role could), and
the same validation as the other sources applies to each chunk
(:func:`dpfed.common.data.encoding.encode_table`).

Errors name the server (host, port, database, user -- never the password) and the table, and
never echo data values.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.data.source_base import DataSource, DataSourceSpec, column_array
from dpfed.common.errors import ConfigError, DataError, DpfedError

logger = logging.getLogger(__name__)

#: Seconds to wait for the server when connecting.
CONNECT_TIMEOUT_S = 15
_CURSOR_NAME = "dpfed_rows"


def _driver() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError("a postgres data source needs the PostgreSQL driver: "
                          "pip install 'dpfed[postgres]' (psycopg 3)") from None
    return psycopg


class PostgresSource(DataSource):
    """A table, view or read-only query in PostgreSQL, fetched ``chunk_rows`` at a time.

    Parameters
    ----------
    spec : DataSourceSpec
        ``kind="postgres"`` with ``conninfo``, optionally ``password``, and one of ``table``
        (``name`` or ``schema.name``) or ``query`` (one ``SELECT``/``WITH`` statement).
    schema : Schema
        The federation schema; its columns are selected by name.

    Raises
    ------
    DataError
        The server cannot be reached or refuses the login, the table does not exist, or a
        schema column is missing.
    ConfigError
        The driver is not installed, or the query is invalid or does more than read.
    """

    def __init__(self, spec: DataSourceSpec, schema: Schema) -> None:
        super().__init__(spec, schema)
        self._psycopg = _driver()
        with self._connect() as conn:
            names = self._execute(conn.cursor(), limit_zero=True)
        self._check_result_columns(list(names))

    def _server(self) -> str:
        try:
            params = self._psycopg.conninfo.conninfo_to_dict(self.spec.conninfo or "")
        except self._psycopg.ProgrammingError:
            return "a server whose conninfo cannot be parsed"
        host = params.get("host") or "localhost"
        port = params.get("port") or "5432"
        return f"{params.get('dbname', '?')} on {host}:{port} as {params.get('user', '?')}"

    def describe(self) -> str:
        """See :meth:`DataSource.describe` (no password, no data)."""
        what = f"table {self.spec.table!r}" if self.spec.table is not None else "query"
        return f"postgres {what} in {self._server()}"

    def _connect(self) -> Any:
        psycopg = self._psycopg
        kwargs: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S,
                                  "application_name": "dpfed-site"}
        if self.spec.password is not None:
            kwargs["password"] = self.spec.password
        try:
            conn = psycopg.connect(self.spec.conninfo or "", **kwargs)
        except psycopg.ProgrammingError as exc:
            raise ConfigError(f"postgres conninfo is invalid: {exc}") from None
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"cannot connect to postgres {self._server()}: {first}") from None
        conn.read_only = True  # every transaction of this session is READ ONLY
        return conn

    def _sql(self, limit_zero: bool) -> Any:
        sql = self._psycopg.sql
        if self.spec.table is not None:
            table = sql.Identifier(*self.spec.table.split("."))
            if limit_zero:  # every column, so a missing one is reported with the others
                return sql.SQL("SELECT * FROM {} LIMIT 0").format(table)
            cols = sql.SQL(", ").join(sql.Identifier(n) for n in self.schema.names)
            return sql.SQL("SELECT {} FROM {}").format(cols, table)
        assert self.spec.query is not None
        query = self.spec.query.strip().rstrip(";")
        if limit_zero:
            return sql.SQL("SELECT * FROM ({}) AS dpfed_source LIMIT 0").format(sql.SQL(query))
        return sql.SQL(query)

    def _execute(self, cursor: Any, *, limit_zero: bool = False) -> list[str]:
        """Run the source's statement on ``cursor``; return its column names."""
        try:
            cursor.execute(self._sql(limit_zero))
        except self._psycopg.Error as exc:
            raise self._error(exc) from None
        return [d.name for d in cursor.description or ()]

    def _error(self, exc: Exception) -> DpfedError:
        """Translate a server error (its primary message never holds row values)."""
        errors = self._psycopg.errors
        diag = getattr(exc, "diag", None)
        message = (diag.message_primary if diag is not None else None) or type(exc).__name__
        if isinstance(exc, errors.ReadOnlySqlTransaction | errors.InsufficientPrivilege):
            return ConfigError(f"{self.describe()}: not allowed: {message}; the site only "
                               "reads (SELECT/WITH on tables it may read)")
        if isinstance(exc, errors.UndefinedTable):
            return DataError(f"{self.describe()}: no such table or view")
        if isinstance(exc, errors.SyntaxError):
            return ConfigError(f"{self.describe()}: invalid query: {message}")
        return DataError(f"{self.describe()}: {message}")

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        names = list(self.schema.names)
        categorical = [not isinstance(c, ContinuousColumn) for c in self.schema.columns]
        chunk = self.chunk_rows
        with self._connect() as conn, conn.cursor(name=_CURSOR_NAME) as cursor:
            # A named cursor lives on the server: rows arrive ``chunk`` at a time.
            cursor.itersize = chunk
            result_names = self._execute(cursor)
            indexes = [result_names.index(n) for n in names]
            while True:
                try:
                    rows = cursor.fetchmany(chunk)
                except self._psycopg.Error as exc:
                    raise self._error(exc) from None
                if not rows:
                    return
                columns = list(zip(*rows, strict=True))
                arrays = [column_array(columns[i], cat)
                          for i, cat in zip(indexes, categorical, strict=True)]
                yield pa.RecordBatch.from_arrays(arrays, names), 0
