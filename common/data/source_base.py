"""What every data source shares: the spec a site configures and the chunked-reader interface.

The readers themselves live in :mod:`dpfed.common.data.data_sources` (CSV, Parquet, SQLite,
and the factory :func:`~dpfed.common.data.data_sources.open_data_source`) and in
:mod:`dpfed.common.data.postgres` (optional driver); both build on this module, so neither
imports the other at module level.
"""

from __future__ import annotations

import abc
import codecs
import logging
import re
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from dpfed.common.data.encoding import EncodedTable, EncodingReport, RowPolicy, encode_table
from dpfed.common.data.parquet_row_groups import RowGroupSize
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


DATA_SOURCE_KINDS: tuple[str, ...] = ("csv", "parquet", "sqlite", "postgres", "duckdb", "omop")
#: File extensions :func:`spec_from_path` understands (a compression suffix such as ``.gz``
#: may follow a CSV extension; Arrow decompresses it while streaming).
CSV_EXTENSIONS: tuple[str, ...] = (".csv", ".tsv", ".txt")
PARQUET_EXTENSIONS: tuple[str, ...] = (".parquet", ".pq")
SQLITE_EXTENSIONS: tuple[str, ...] = (".sqlite", ".sqlite3", ".db")
DUCKDB_EXTENSIONS: tuple[str, ...] = (".duckdb", ".ddb")
#: A file describing an OMOP CDM extraction (dpfed.common.data.omop): ``site-a.omop.toml``.
OMOP_SUFFIX = ".omop.toml"
COMPRESSION_EXTENSIONS: tuple[str, ...] = (".gz", ".bz2", ".zst", ".lz4")
DEFAULT_CHUNK_ROWS = 65536
#: Key in ``EncodingReport.problems_by_column`` under which CSV rows with a wrong number of
#: fields are counted (they are also counted in ``rows_read`` and ``dropped_invalid``).
MALFORMED_ROWS_KEY = "(rows with a wrong number of fields)"

_HEADER_SAMPLE_BYTES = 1 << 20
_BLOCK_BYTES = 1 << 20
_MAX_BLOCK_BYTES = 8 << 20
_BLOCK_ROWS = 1024
#: Cap on one chunk's float64 feature matrix: wide tables get fewer rows per chunk.
MAX_CHUNK_BYTES = 128 << 20
#: Below :data:`MAX_CHUNK_BYTES`, a chunk's matrix is kept to the size of one p x p matrix
#: (the unit of a site's memory budget), but never below this.
MIN_CHUNK_BYTES = 16 << 20
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SQL_COMMENT = re.compile(r"\A\s*(?:--[^\n]*(?:\n|\Z)|/\*.*?\*/)", re.DOTALL)


# ---------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class DataSourceSpec:
    """Where a site's table lives and how to read it.

    Attributes
    ----------
    kind : {"csv", "parquet", "sqlite", "postgres", "duckdb", "omop"}
        The format.
    path : pathlib.Path
        The file (a str is converted): a Parquet file or dataset directory, a database file,
        or for ``omop`` the extraction's ``.omop.toml`` (:mod:`dpfed.common.data.omop`).
    table : str, optional
        SQLite, PostgreSQL and DuckDB: a table or view name (a plain identifier
        ``[A-Za-z_][A-Za-z0-9_]*``; ``schema.table`` for PostgreSQL and DuckDB).
    query : str, optional
        Instead of ``table``: one read-only ``SELECT``/``WITH`` statement whose result has the
        schema's columns (by name).
    delimiter : str
        CSV only: the one-character field separator (``","``; a tab for ``.tsv``).
    chunk_rows : int
        Rows per chunk (>= 1); memory is proportional to ``chunk_rows x columns``.
    policy : RowPolicy
        What to do with missing, invalid and out-of-range values. CSV rows with a wrong
        number of fields follow ``policy.invalid``.
    encoding : str
        CSV only: the text encoding of the file (Arrow transcodes anything but UTF-8, which is
        slower).
    conninfo : str, optional
        PostgreSQL only: a libpq connection string or URI without the password
        (``"host=db port=5432 dbname=omop user=dpfed_reader sslmode=verify-full"``).
    password : str, optional
        PostgreSQL only: the password, read from an environment variable or a file by the
        caller (never printed: it is left out of ``repr``).
    """

    kind: str
    path: Path | None
    table: str | None = None
    query: str | None = None
    delimiter: str = ","
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    policy: RowPolicy = field(default_factory=RowPolicy)
    encoding: str = "utf-8"
    conninfo: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in DATA_SOURCE_KINDS:
            raise ConfigError(
                f"data source kind must be one of {', '.join(DATA_SOURCE_KINDS)}, "
                f"got {self.kind!r}"
            )
        if self.kind == "postgres":
            if self.path is not None:
                raise ConfigError("a postgres data source has no path; give its conninfo")
            if not isinstance(self.conninfo, str):
                raise ConfigError("a postgres data source needs a conninfo (libpq connection "
                                  "string such as \"host=db dbname=omop user=reader\")")
        else:
            if not isinstance(self.path, str | Path) or not str(self.path):
                raise ConfigError(
                    f"data source path must be a non-empty path, got {self.path!r}")
            object.__setattr__(self, "path", Path(self.path))
            if self.conninfo is not None or self.password is not None:
                raise ConfigError(f"'conninfo' and 'password' apply only to postgres data "
                                  f"sources, not {self.kind} ({self.path})")
        if (isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int)
                or self.chunk_rows < 1):
            raise ConfigError(f"chunk_rows must be an integer >= 1, got {self.chunk_rows!r}")
        if not isinstance(self.policy, RowPolicy):
            raise ConfigError(f"policy must be a RowPolicy, got {type(self.policy).__name__}")
        if self.kind in ("sqlite", "postgres", "duckdb"):
            where = "postgres" if self.kind == "postgres" else self.path
            if (self.table is None) == (self.query is None):
                raise ConfigError(
                    f"an {self.kind} data source ({where}) needs exactly one of 'table' or "
                    f"'query', got {'both' if self.table is not None else 'neither'}"
                )
            if self.table is not None:
                _check_identifier(self.table, self.kind)
            if self.query is not None:
                _check_select(self.query, self.kind)
        elif self.table is not None or self.query is not None:
            raise ConfigError(
                f"'table' and 'query' apply only to sqlite, postgres and duckdb data sources, "
                f"not {self.kind} ({self.path})"
            )
        if (not isinstance(self.delimiter, str) or len(self.delimiter) != 1
                or self.delimiter in "\"\r\n"):
            raise ConfigError(
                "delimiter must be one character other than a quote or a line break, "
                f"got {self.delimiter!r}"
            )
        try:
            codecs.lookup(self.encoding)
        except (LookupError, TypeError):
            raise ConfigError(
                f"encoding must be a Python codec name such as 'utf-8' or 'latin-1', "
                f"got {self.encoding!r}"
            ) from None


def spec_from_path(path: str | Path, *, table: str | None = None, query: str | None = None,
                   delimiter: str | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                   policy: RowPolicy | None = None, encoding: str = "utf-8") -> DataSourceSpec:
    """Build a :class:`DataSourceSpec`, taking the kind from the file extension.

    ``.csv``/``.tsv``/``.txt`` (optionally followed by ``.gz``, ``.bz2``, ``.zst`` or
    ``.lz4``) are CSV (``.tsv`` defaults to a tab delimiter), ``.parquet``/``.pq`` Parquet,
    ``.sqlite``/``.sqlite3``/``.db`` SQLite and ``.duckdb``/``.ddb`` DuckDB, which also need
    ``table`` or ``query``, and ``.omop.toml`` an OMOP CDM extraction (``omop``). An
    existing directory (without a CSV or SQLite extension) is a Parquet dataset: every
    Parquet file under it.

    Raises
    ------
    ConfigError
        For an extension not listed above, or an invalid combination of options.
    """
    p = Path(path)
    suffixes = [s.lower() for s in p.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_EXTENSIONS:
        suffixes = suffixes[:-1]
    ext = suffixes[-1] if suffixes else ""
    if p.name.lower().endswith(OMOP_SUFFIX):
        kind = "omop"
    elif p.is_dir() and ext not in CSV_EXTENSIONS + SQLITE_EXTENSIONS:
        kind = "parquet"
    elif ext in CSV_EXTENSIONS:
        kind = "csv"
        if delimiter is None:
            delimiter = "\t" if ext == ".tsv" else ","
    elif ext in PARQUET_EXTENSIONS and len(p.suffixes) == len(suffixes):
        kind = "parquet"
    elif ext in SQLITE_EXTENSIONS and len(p.suffixes) == len(suffixes):
        kind = "sqlite"
    elif ext in DUCKDB_EXTENSIONS and len(p.suffixes) == len(suffixes):
        kind = "duckdb"
    else:
        known = (CSV_EXTENSIONS + PARQUET_EXTENSIONS + SQLITE_EXTENSIONS + DUCKDB_EXTENSIONS
                 + (OMOP_SUFFIX,))
        raise ConfigError(
            f"cannot tell the format of data file {p} from its extension; use one of "
            f"{', '.join(known)} (CSV may be compressed: .csv.gz) or give the kind explicitly"
        )
    return DataSourceSpec(kind, p, table=table, query=query,
                          delimiter="," if delimiter is None else delimiter,
                          chunk_rows=chunk_rows, policy=policy or RowPolicy(), encoding=encoding)


def _check_identifier(name: Any, kind: str = "sqlite") -> str:
    """Check a plain identifier; PostgreSQL also takes ``schema.table`` (OMOP CDM views)."""
    qualifies = kind in ("postgres", "duckdb")
    parts = name.split(".") if isinstance(name, str) and qualifies else [name]
    if not isinstance(name, str) or len(parts) > 2 or not all(
            isinstance(p, str) and _IDENTIFIER.match(p) for p in parts):
        qualified = " or schema.table" if qualifies else ""
        raise ConfigError(
            f"{kind} table must be a plain identifier{qualified} (letters, digits, underscore; "
            f"not starting with a digit), got {name!r}; use 'query' for anything else"
        )
    return name


def _check_select(query: Any, kind: str = "sqlite") -> str:
    """Refuse anything that is not one SELECT/WITH statement (the database is read-only too)."""
    if not isinstance(query, str) or not query.strip():
        raise ConfigError(f"{kind} query must be a non-empty string, got {query!r}")
    text = query
    while True:
        m = _SQL_COMMENT.match(text)
        if not m:
            break
        text = text[m.end():]
    first = re.match(r"\s*([A-Za-z]+)", text)
    if not first or first.group(1).upper() not in ("SELECT", "WITH"):
        raise ConfigError(
            f"{kind} query must be a single read-only SELECT or WITH statement, "
            f"got one starting with {(first.group(1) if first else text.strip()[:1])!r}"
        )
    body = text.strip().rstrip(";").rstrip()
    if ";" in body and _splits_into_statements(body):
        raise ConfigError(f"{kind} query must be a single statement, got several separated by "
                          "';'")
    return query


def _splits_into_statements(body: str) -> bool:
    """Return True if ``body`` holds a complete statement followed by more text."""
    for i, ch in enumerate(body):
        if ch == ";" and sqlite3.complete_statement(body[:i + 1]) and body[i + 1:].strip():
            return True
    return False


def _quote_identifier(name: str) -> str:
    """SQL-quote any identifier (the schema's column names may contain spaces or quotes)."""
    if "\x00" in name:
        raise ConfigError(f"column name {name!r} contains a NUL character")
    return '"' + name.replace('"', '""') + '"'


def _check_readable_file(path: Path, what: str) -> None:
    if not path.exists():
        raise DataError(f"{what} not found: {path}")
    if path.is_dir():
        raise DataError(f"{what} {path} is a directory; expected a file")
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise DataError(f"{what} {path} is not readable (permission denied)") from None
    except OSError as exc:
        raise DataError(f"cannot open {what} {path}: {exc.strerror}") from None


# ---------------------------------------------------------------------------------- sources
class DataSource(abc.ABC):
    """A table read chunk by chunk; create one with :func:`open_data_source`."""

    def __init__(self, spec: DataSourceSpec, schema: Schema) -> None:
        self.spec = spec
        self.schema = schema

    @property
    def path(self) -> Path:
        """The file of a file-based source."""
        if self.spec.path is None:
            raise ConfigError(f"a {self.spec.kind} data source has no file")
        return self.spec.path

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk: ``spec.chunk_rows``, fewer for wide tables.

        A chunk's float64 matrix is kept to ``8 p^2`` bytes -- one p x p matrix -- within
        [:data:`MIN_CHUNK_BYTES`, :data:`MAX_CHUNK_BYTES`] (16 MiB to 128 MiB): at p = 5000 a
        65536-row chunk would be 2.4 GiB, more than the p x p matrices of a PCA, and at
        p = 1000 the 128 MiB chunks (and the copies a pass holds of them) were most of the
        site's memory, 40 times the p x p matrices.
        """
        p = max(1, len(self.schema.columns))
        budget = min(max(8 * p * p, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        return max(1, min(self.spec.chunk_rows, budget // (8 * p)))

    def _check_result_columns(self, names: list[str]) -> None:
        """Check a table's or query's column names: every schema column, each once.

        Raises
        ------
        DataError
            Naming the missing or repeated columns and the ones there are.
        """
        missing = [n for n in self.schema.names if n not in names]
        if missing:
            raise DataError(f"{self.describe()}: has no column(s) {missing} that the schema "
                            f"needs; its columns are {names}")
        dupes = sorted(n for n in self.schema.names if names.count(n) > 1)
        if dupes:
            raise DataError(f"{self.describe()}: names column(s) {dupes} more than once")

    @abc.abstractmethod
    def describe(self) -> str:
        """Kind and location of the data (never any data), for logs and error messages."""

    def largest_row_group(self) -> RowGroupSize | None:
        """Return the largest unit the reader decodes whole (Parquet row groups; else None)."""
        return None

    def check_sample(self, rows: int = 1000) -> EncodingReport:
        """Read and encode at most the first ``rows`` rows of the first chunk.

        What a site checks at start-up besides the columns that :func:`open_data_source`
        checks: the values parse, and a row policy of "error" holds on the first rows. It
        reads one chunk (one CSV block, one Parquet batch, one fetch), never the whole table:
        at p = 5000 a CSV block holds ~300 rows and reading 1000 took 5 s.

        Raises
        ------
        DataError
            As :meth:`iter_chunks`, for the rows read.
        """
        source = self.describe()
        batches = self._batches()
        total = EncodingReport()
        try:
            for batch, skipped in batches:
                take = batch.slice(0, max(0, rows - total.rows_read))
                _, report = encode_table(self.schema, take, policy=self.spec.policy,
                                         row_offset=total.rows_read, source=source)
                report.rows_read += skipped
                report.dropped_invalid += skipped
                total.merge(report)
                if total.rows_read > 0:
                    break
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if total.rows_read == 0:
            raise DataError(f"{source}: contains no data rows")
        return total

    @abc.abstractmethod
    def _batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Yield ``(batch of schema columns, rows skipped before encoding since last batch)``."""

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        """Stream the data as encoded chunks of at most ``spec.chunk_rows`` rows.

        Each call starts again from the beginning of the source. The reports of all chunks
        merged (:meth:`EncodingReport.merge`) give the counts for the whole source.

        Raises
        ------
        DataError
            When the source has no data rows, cannot be parsed, or a row breaks a policy whose
            action is "error" (see the module docstring for how rows are numbered).
        """
        source = self.describe()
        row_offset = 0
        seen_rows = False
        for batch, skipped in self._batches():
            table, report = encode_table(self.schema, batch, policy=self.spec.policy,
                                         row_offset=row_offset, source=source)
            if skipped:
                report.merge(EncodingReport(rows_read=skipped, dropped_invalid=skipped,
                                            problems_by_column={MALFORMED_ROWS_KEY:
                                                                {"invalid": skipped}}))
            row_offset += batch.num_rows
            seen_rows = seen_rows or report.rows_read > 0
            yield table, report
        if not seen_rows:
            raise DataError(f"{source}: contains no data rows")

    def _empty_batch(self) -> pa.RecordBatch:
        names = list(self.schema.names)
        return pa.RecordBatch.from_arrays([pa.array([], pa.string()) for _ in names], names)


def column_array(values: Sequence[Any], categorical: bool) -> pa.Array:
    """Arrow array of one column fetched from a database; mixed or binary columns become text."""
    try:
        arr = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        arr = None
    if arr is not None and not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(
            arr.type)):
        return arr
    return pa.array([_database_text(v, categorical) for v in values], pa.string())


def _database_text(value: Any, categorical: bool) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if categorical and isinstance(value, float) and value.is_integer():
        return str(int(value))  # level "2" stored as REAL 2.0
    return str(value)  # repr of a float round-trips exactly
