"""Read a site's table in chunks: CSV, Parquet, SQLite or PostgreSQL, never all at once.

A site agent points a :class:`DataSourceSpec` at its data, and :func:`open_data_source`
checks at once that the file (or table, or query) exists and has every schema column, so a
wrong path or a missing column stops the agent at start-up with a message that names it;
:meth:`DataSource.check_sample` reads and validates the first rows (never the whole table).
The source then streams ``(EncodedTable, EncodingReport)`` pairs of at most ``chunk_rows``
rows (:meth:`DataSource.iter_chunks`), each chunk validated by
:func:`dpfed.common.data.encoding.encode_table` under the spec's
:class:`~dpfed.common.data.encoding.RowPolicy`. Chunks are never joined: a CSV block (sized
to hold about ``chunk_rows`` rows, 1-8 MiB) or a Parquet batch is one chunk, cut if longer.
Wide tables get fewer rows per chunk (:attr:`DataSource.chunk_rows`, a 128 MiB cap on the
float64 chunk). Memory is bounded by the chunk whatever the size of the table
(docs/data-sources.md; ``bench/site_memory.py`` and ``bench/wide_site.py`` measure it).
PostgreSQL lives in :mod:`dpfed.common.data.postgres` (optional driver).

Errors never echo data values: they name the source, the column and the row.

Row numbers
    ``encode_table`` errors name the *data row*: the 1-based index among the well-formed data
    rows (the header and CSV rows skipped for a wrong number of fields are not counted). A CSV
    row with a wrong number of fields is reported by its row number in the file, the header
    being row 1 (blank lines are not counted; a quoted value with a line break is one row).

CSV fast path
    Reading every column as text lets ``encode_table`` apply the row policy to bad values
    instead of failing a whole block, but costs ~2x end to end (read + encode) on a numeric
    table (``bench/site_memory.py`` measures it). So continuous columns are first read as float64
    by Arrow; as soon as a block fails to convert (a value that is not a plain number or a
    declared missing value, stray whitespace, ...) the rest of the file is read as text. The
    text reader re-parses the rows already delivered and discards them, so results do not
    depend on which path read a row.
"""

from __future__ import annotations

import codecs
import csv
import logging
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.parquet_row_groups import RowGroupSize, largest_row_group
from dpfed.common.data.schema import Column, ContinuousColumn, DateColumn, Schema
from dpfed.common.data.source_base import (
    _BLOCK_BYTES,
    _BLOCK_ROWS,
    _HEADER_SAMPLE_BYTES,
    _MAX_BLOCK_BYTES,
    _check_readable_file,
    _quote_identifier,
)
from dpfed.common.data.source_base import (
    COMPRESSION_EXTENSIONS as COMPRESSION_EXTENSIONS,
)
from dpfed.common.data.source_base import (
    CSV_EXTENSIONS as CSV_EXTENSIONS,
)
from dpfed.common.data.source_base import (  # the base lives apart: postgres builds on it
    DATA_SOURCE_KINDS as DATA_SOURCE_KINDS,
)
from dpfed.common.data.source_base import (
    DEFAULT_CHUNK_ROWS as DEFAULT_CHUNK_ROWS,
)
from dpfed.common.data.source_base import (
    MALFORMED_ROWS_KEY as MALFORMED_ROWS_KEY,
)
from dpfed.common.data.source_base import (
    MAX_CHUNK_BYTES as MAX_CHUNK_BYTES,
)
from dpfed.common.data.source_base import (
    PARQUET_EXTENSIONS as PARQUET_EXTENSIONS,
)
from dpfed.common.data.source_base import (
    SQLITE_EXTENSIONS as SQLITE_EXTENSIONS,
)
from dpfed.common.data.source_base import (
    DataSource as DataSource,
)
from dpfed.common.data.source_base import (
    DataSourceSpec as DataSourceSpec,
)
from dpfed.common.data.source_base import (
    column_array as column_array,
)
from dpfed.common.data.source_base import (
    spec_from_path as spec_from_path,
)
from dpfed.common.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

class CsvSource(DataSource):
    """A delimited text file with a header row, streamed with ``pyarrow.csv.open_csv``.

    Parameters
    ----------
    spec, schema
        See :func:`open_data_source`.
    typed_fast_path : bool
        Read continuous columns as float64 until a block fails to convert (module
        docstring). ``False`` reads everything as text; the results are the same.
    """

    def __init__(self, spec: DataSourceSpec, schema: Schema, *,
                 typed_fast_path: bool = True) -> None:
        super().__init__(spec, schema)
        self.typed_fast_path = typed_fast_path
        _check_readable_file(self.path, "data file")
        self.header, self.block_size = self._read_header()
        counts: dict[str, int] = {}
        for name in self.header:
            counts[name] = counts.get(name, 0) + 1
        missing = [n for n in schema.names if n not in counts]
        if missing:
            hint = ""
            if len(self.header) == 1 and any(d in self.header[0] for d in ",;\t|"):
                hint = (f" (the header split into one column with delimiter "
                        f"{spec.delimiter!r}: is the delimiter right?)")
            raise DataError(
                f"{self.describe()}: header has no column(s) {missing} that the schema needs; "
                f"the header is {self.header}{hint}"
            )
        dupes = sorted(n for n in schema.names if counts[n] > 1)
        if dupes:
            raise DataError(f"{self.describe()}: header names column(s) {dupes} more than once")

    def describe(self) -> str:
        """See :meth:`DataSource.describe`."""
        return f"csv file {self.path}"

    def _read_header(self) -> tuple[list[str], int]:
        """Parse the header row; return (column names, Arrow block size for ~chunk_rows rows)."""
        path = self.path
        try:
            with pa.input_stream(str(path), compression="detect") as stream:
                sample = bytes(stream.read(_HEADER_SAMPLE_BYTES))
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"cannot read {self.describe()}: {type(exc).__name__}") from None
        text_sample = self._decode(sample)
        if text_sample.startswith("\ufeff"):
            text_sample = text_sample[1:]
        if not text_sample.strip():
            raise DataError(f"{self.describe()}: the file is empty (expected a header row)")
        newline = text_sample.find("\n")
        if newline < 0 and len(sample) == _HEADER_SAMPLE_BYTES:
            raise DataError(f"{self.describe()}: no line break in the first "
                            f"{_HEADER_SAMPLE_BYTES} bytes; is this a CSV file?")
        first_line = text_sample if newline < 0 else text_sample[:newline]
        rest = "" if newline < 0 else text_sample[newline + 1:]
        if not rest.strip() and len(sample) < _HEADER_SAMPLE_BYTES:
            raise DataError(f"{self.describe()}: has a header row but no data rows")
        try:
            header = next(csv.reader([first_line.rstrip("\r")], delimiter=self.spec.delimiter,
                                     quotechar='"', doublequote=True, strict=True))
        except (csv.Error, StopIteration):
            raise DataError(f"{self.describe()}: the header row is not valid CSV") from None
        header = [name.strip() for name in header]
        # Block size, by bytes per row: enough for _BLOCK_ROWS rows (per-column work is
        # paid per block: at p = 2000 a 1 MiB block held ~90 rows and the pass took 3x as
        # long as with 8 MiB), within [_BLOCK_BYTES, _MAX_BLOCK_BYTES] (Arrow keeps a fixed
        # number of blocks in flight, so memory grows with the block: ~40 MiB at 1 MiB,
        # ~290 MiB at 8 MiB; narrow tables are also parsed fastest in 1 MiB blocks), at most
        # chunk_rows rows' worth, and at least 4x the sample's longest line (Arrow fails on
        # a row longer than a block). Each block is one chunk: blocks are never joined (at
        # p = 5000 joining 1 MiB blocks into chunks cost more than parsing them).
        body = sample[sample.find(b"\n") + 1:]
        ends = np.flatnonzero(np.frombuffer(body, dtype=np.uint8) == ord("\n"))
        longest = int(np.diff(ends, prepend=-1).max()) if ends.size else len(body)
        per_row = (int(ends[-1]) + 1) / ends.size if ends.size else float(len(body) or 1)
        wanted = int(per_row * min(self.chunk_rows, _BLOCK_ROWS) * 1.05)
        return header, max(min(max(wanted, _BLOCK_BYTES), _MAX_BLOCK_BYTES), 4 * longest)

    def _decode(self, data: bytes) -> str:
        try:
            return data.decode(self.spec.encoding)
        except UnicodeDecodeError as exc:
            if len(data) == _HEADER_SAMPLE_BYTES and exc.start > len(data) - 4:
                # The sample may end inside a multi-byte character.
                return data[:exc.start].decode(self.spec.encoding)
            line = data[:exc.start].count(b"\n") + 1
            raise DataError(
                f"{self.describe()}: line {line} is not valid {self.spec.encoding} text; "
                "re-encode the file (e.g. with iconv) or set the data source's encoding"
            ) from None

    def _open(self, typed: bool, malformed: _MalformedRows) -> Any:
        column_types = {
            col.name: pa.float64() if typed and _plain_number(col) else pa.string()
            for col in self.schema.columns
        }
        encoding = self.spec.encoding
        if codecs.lookup(encoding).name == "utf-8":
            encoding = "utf8"  # Arrow's no-transcoding fast path
        # use_threads=False: row numbers reach the invalid-row handler only when Arrow parses
        # serially (and serial parsing measured as fast here). The header was parsed by
        # _read_header, so Arrow skips it and takes the stripped names.
        read = pcsv.ReadOptions(block_size=self.block_size, use_threads=False, skip_rows=1,
                                column_names=self.header, encoding=encoding)
        parse = pcsv.ParseOptions(delimiter=self.spec.delimiter, quote_char='"',
                                  double_quote=True, invalid_row_handler=malformed)
        convert = pcsv.ConvertOptions(include_columns=list(self.schema.names),
                                      column_types=column_types,
                                      null_values=list(self.schema.missing_values),
                                      strings_can_be_null=True)
        return pcsv.open_csv(str(self.path), read_options=read, parse_options=parse,
                             convert_options=convert)

    def _arrow_batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Yield Arrow batches in file order, switching to text reading if a block fails."""
        malformed = _MalformedRows(fail=self.spec.policy.invalid == "error")
        typed = self.typed_fast_path and any(_plain_number(c) for c in self.schema.columns)
        delivered = 0  # well-formed data rows handed out so far
        while True:
            to_discard = delivered  # after a switch, rows the typed reader already delivered
            try:
                # open_csv already reads and converts the first block.
                reader = self._open(typed, malformed)
                for batch in reader:
                    if to_discard:
                        if batch.num_rows <= to_discard:
                            to_discard -= batch.num_rows
                            continue
                        batch = batch.slice(to_discard)
                        to_discard = 0
                    delivered += batch.num_rows
                    yield batch, malformed.take_pending()
                if to_discard:
                    raise DataError(f"{self.describe()}: the file changed while it was read")
                pending = malformed.take_pending()
                if pending:
                    yield self._empty_batch(), pending
                return
            except OSError as exc:
                raise DataError(f"cannot read {self.describe()}: {exc.strerror}") from None
            except pa.ArrowInvalid as exc:
                if malformed.error_line is not None or not typed:
                    raise self._arrow_error(exc, malformed, delivered) from None
                # Fast path failed on this block: read the rest of the file as text. Rows
                # with a wrong field count already counted are not counted again.
                logger.info("[CsvSource.iter_chunks] %s: a block after data row %d is not "
                            "plain numbers; reading the rest as text", self.describe(),
                            delivered)
                typed = False
                malformed.rewind()

    def _arrow_error(self, exc: pa.ArrowInvalid, malformed: _MalformedRows,
                     delivered: int) -> DataError:
        """Translate an Arrow error without repeating its text (it can quote data values)."""
        where = self.describe()
        if malformed.error_line is not None:
            return DataError(
                f"{where}: row {malformed.error_line} of the file (header = row 1) has "
                f"{malformed.error_actual} fields, the header has {malformed.error_expected}; "
                "set on_invalid = \"drop\" to skip such rows"
            )
        message = str(exc)
        near = f"after data row {delivered}" if delivered else "in the first block"
        if "UTF8" in message or "UTF-8" in message:
            column = ""
            m = re.search(r"CSV column #(\d+)", message)
            if m and int(m.group(1)) < len(self.header):
                column = f" in column {self.header[int(m.group(1))]!r}"
            return DataError(
                f"{where}: text that is not valid UTF-8{column} {near}; re-encode the file "
                "(e.g. with iconv) or set the data source's encoding"
            )
        if "straddl" in message or "block" in message.lower():
            return DataError(
                f"{where}: a row {near} is longer than the read block ({self.block_size} "
                "bytes) or has an unterminated quote"
            )
        return DataError(
            f"{where}: cannot be parsed as delimited text {near} (check the delimiter "
            f"{self.spec.delimiter!r}, quoting and encoding)"
        )

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        return _split(self._arrow_batches(), self.chunk_rows)


def _plain_number(col: Column) -> bool:
    """Whether the CSV fast path reads the column as float64 (continuous, not a date)."""
    return isinstance(col, ContinuousColumn) and not isinstance(col, DateColumn)


class _MalformedRows:
    """Arrow ``invalid_row_handler``: count rows with a wrong number of fields, or stop.

    Raising inside the handler is swallowed by Arrow, so on "error" it records the row and
    returns "error"; the reader then raises and :meth:`CsvSource._arrow_error` reports it.
    """

    def __init__(self, *, fail: bool) -> None:
        self.fail = fail
        self.pending = 0
        self.counted_through = 0  # highest row number counted (Arrow numbers rows serially)
        self.replay_through = 0  # after a rewind: rows up to here were counted already
        self.error_line: int | None = None
        self.error_expected = 0
        self.error_actual = 0

    def __call__(self, row: Any) -> str:
        number = int(row.number) if row.number is not None else None
        if number is not None and number <= self.replay_through:
            return "skip"
        if self.fail:
            self.error_line = number
            self.error_expected = int(row.expected_columns)
            self.error_actual = int(row.actual_columns)
            return "error"
        self.pending += 1
        if number is not None:
            self.counted_through = max(self.counted_through, number)
        return "skip"

    def take_pending(self) -> int:
        n, self.pending = self.pending, 0
        return n

    def rewind(self) -> None:
        self.replay_through = self.counted_through


def _split(batches: Iterator[tuple[pa.RecordBatch, int]],
           chunk_rows: int) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Cut batches longer than ``chunk_rows`` into zero-copy slices; never join batches.

    Joining short batches into full chunks copied every value once more than the floor of a
    pass does; chunks are therefore *at most* ``chunk_rows`` rows. Skip counts travel with
    the first slice.
    """
    for batch, skip in batches:
        if batch.num_rows <= chunk_rows:
            yield batch, skip
            continue
        for start in range(0, batch.num_rows, chunk_rows):
            yield batch.slice(start, chunk_rows), skip
            skip = 0


class ParquetSource(DataSource):
    """A Parquet file streamed with ``ParquetFile.iter_batches`` (only the schema's columns)."""

    def __init__(self, spec: DataSourceSpec, schema: Schema) -> None:
        super().__init__(spec, schema)
        _check_readable_file(self.path, "data file")
        pf = self._open()
        try:
            names = list(pf.schema_arrow.names)
            self.num_rows = int(pf.metadata.num_rows)
        finally:
            pf.close()
        missing = [n for n in schema.names if n not in names]
        if missing:
            raise DataError(f"{self.describe()}: has no column(s) {missing} that the schema "
                            f"needs; its columns are {names}")

    def describe(self) -> str:
        """See :meth:`DataSource.describe`."""
        return f"parquet file {self.path}"

    def largest_row_group(self) -> RowGroupSize | None:
        """See :meth:`DataSource.largest_row_group` (the file's footer only)."""
        return largest_row_group([str(self.path)], self.schema.names)

    def _open(self) -> Any:
        try:
            # pre_buffer=False: with pre-buffering (pyarrow's default) the reader kept the
            # buffered column chunks of every row group read so far, so allocation grew with
            # the file (67 -> 195 MiB over a 2M-row file; cf. apache/arrow#39808). Without
            # it, it stays at ~one row group.
            return pq.ParquetFile(str(self.path), pre_buffer=False)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.describe()}: not a readable Parquet file "
                            f"({type(exc).__name__})") from None

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        pf = self._open()
        try:
            # Batches end at row-group boundaries; they are passed on as they come.
            for batch in pf.iter_batches(batch_size=self.chunk_rows,
                                         columns=list(self.schema.names), use_threads=False):
                yield batch, 0
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.describe()}: cannot be read ({type(exc).__name__})") from None
        finally:
            pf.close()


_READ_ONLY_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ,
                                sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE})


def _read_only_authorizer(action: int, arg1: str | None, arg2: str | None,
                          db_name: str | None, trigger: str | None) -> int:
    """SQLite authorizer that allows reading only (defence in depth on top of mode=ro)."""
    return sqlite3.SQLITE_OK if action in _READ_ONLY_ACTIONS else sqlite3.SQLITE_DENY


class SqliteSource(DataSource):
    """A table, view or read-only query in an SQLite database, fetched ``chunk_rows`` at a time.

    The database is opened read-only (URI ``mode=ro``) with an authorizer that allows only
    reads, so a query cannot change it. SQLite values are dynamically typed: a column that
    mixes numbers and text is read as text and ``encode_table`` applies the row policy.
    """

    def __init__(self, spec: DataSourceSpec, schema: Schema) -> None:
        super().__init__(spec, schema)
        _check_readable_file(self.path, "database file")
        with self._connect() as conn:
            if spec.table is not None:
                try:
                    tables = [r[0] for r in conn.execute(
                        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
                        "ORDER BY name")]
                except sqlite3.DatabaseError as exc:
                    raise DataError(f"{self.describe()}: cannot be read as an SQLite database "
                                    f"({exc})") from None
                if spec.table not in tables:
                    raise DataError(f"{self.describe()}: no such table or view; the database "
                                    f"has {tables}")
            cursor = self._execute(conn, limit_zero=True)
            names = [d[0] for d in cursor.description]
            cursor.close()
        self._check_result_columns(list(names))

    def describe(self) -> str:
        """See :meth:`DataSource.describe`."""
        if self.spec.table is not None:
            return f"sqlite table {self.spec.table!r} in {self.path}"
        return f"sqlite query on {self.path}"

    def _connect(self) -> _ClosingConnection:
        uri = self.path.resolve().as_uri() + "?mode=ro"
        try:
            conn = sqlite3.connect(uri, uri=True)
        except sqlite3.Error as exc:
            raise DataError(f"cannot open {self.describe()}: {exc}") from None
        conn.set_authorizer(_read_only_authorizer)
        return _ClosingConnection(conn)

    def _sql(self, limit_zero: bool) -> str:
        if self.spec.table is not None:
            cols = ", ".join(_quote_identifier(n) for n in self.schema.names)
            sql = f"SELECT {cols} FROM {_quote_identifier(self.spec.table)}"
            return sql + " LIMIT 0" if limit_zero else sql
        assert self.spec.query is not None
        return self.spec.query

    def _execute(self, conn: sqlite3.Connection, *, limit_zero: bool = False) -> sqlite3.Cursor:
        try:
            return conn.execute(self._sql(limit_zero))
        except sqlite3.DatabaseError as exc:
            text = str(exc)
            if "not authorized" in text:
                raise ConfigError(f"{self.describe()}: the query does something other than "
                                  "read; only SELECT/WITH queries are allowed") from None
            if isinstance(exc, sqlite3.ProgrammingError) or "syntax" in text:
                raise ConfigError(f"{self.describe()}: invalid query: {text}") from None
            raise DataError(f"{self.describe()}: {text}") from None

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        names = list(self.schema.names)
        with self._connect() as conn:
            cursor = self._execute(conn)
            result_names = [d[0] for d in cursor.description]
            indexes = [result_names.index(n) for n in names]
            categorical = [not isinstance(c, ContinuousColumn) for c in self.schema.columns]
            while True:
                try:
                    rows = cursor.fetchmany(self.chunk_rows)
                except sqlite3.DatabaseError as exc:
                    raise DataError(f"{self.describe()}: {exc}") from None
                if not rows:
                    return
                columns = list(zip(*rows, strict=True))
                arrays = [column_array(columns[i], cat) for i, cat in zip(indexes, categorical,
                                                                            strict=True)]
                yield pa.RecordBatch.from_arrays(arrays, names), 0


class _ClosingConnection:
    """Context manager that closes an sqlite3 connection (its own ``with`` only commits)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


# ---------------------------------------------------------------------------------- helpers
def open_data_source(spec: DataSourceSpec, schema: Schema) -> DataSource:
    """Open and check a data source: the file exists and has every schema column.

    Raises
    ------
    DataError
        The file is missing, a directory, unreadable, empty, not in the declared format, or
        lacks a schema column (the message lists what it has).
    ConfigError
        The SQLite query is not a single read-only statement.
    """
    if spec.kind == "csv":
        return CsvSource(spec, schema)
    if spec.kind == "parquet":
        from dpfed.common.data.parquet_dataset import ParquetDatasetSource, is_dataset_path

        if is_dataset_path(spec.path or Path()):
            return ParquetDatasetSource(spec, schema)
        return ParquetSource(spec, schema)
    if spec.kind == "postgres":
        # Imported here: the driver is the optional extra ``dpfed[postgres]``.
        from dpfed.common.data.postgres import PostgresSource

        return PostgresSource(spec, schema)
    if spec.kind == "duckdb":
        from dpfed.common.data.duckdb_source import DuckDBSource

        return DuckDBSource(spec, schema)
    if spec.kind == "omop":
        from dpfed.common.data.omop import OmopSource, inner_spec

        return OmopSource(spec, schema, open_data_source(inner_spec(spec, schema), schema))
    return SqliteSource(spec, schema)


def read_all(source: DataSource) -> tuple[EncodedTable, EncodingReport]:
    """Read a whole (small) source into memory: all chunks concatenated, reports merged."""
    parts: list[EncodedTable] = []
    total = EncodingReport()
    for table, report in source.iter_chunks():
        parts.append(table)
        total.merge(report)
    return EncodedTable.concatenate(parts), total


def scan(source: DataSource) -> EncodingReport:
    """Stream the whole source and return only the merged counts (no rows are kept)."""
    total = EncodingReport()
    for _, report in source.iter_chunks():
        total.merge(report)
    return total
