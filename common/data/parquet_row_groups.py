"""How much a site must hold to read its Parquet data: the largest row group, from metadata.

Arrow reads a Parquet file one row group at a time and decodes the whole group before the
first batch of it is returned (``iter_batches``, the dataset scanner and DuckDB alike), so a
site's reading memory follows the largest row group, not ``chunk_rows``: measured peaks were
1.5-7x a group's decoded size (docs/data-sources.md, "Memory"). Files written with a writer's
default row groups (pyarrow: up to 1,048,576 rows) can then need gigabytes on a wide table.
``dpfed-site check`` reads only the footers (no data) and warns above
:data:`WARN_ROW_GROUP_BYTES`, saying how many rows per group would fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from dpfed.common.errors import DataError

#: Decoded row-group size above which ``dpfed-site check`` warns (256 MiB).
WARN_ROW_GROUP_BYTES = 256 * 2 ** 20
#: The row-group size the warning suggests writing instead (64 MiB decoded).
SUGGESTED_ROW_GROUP_BYTES = 64 * 2 ** 20


@dataclass(frozen=True)
class RowGroupSize:
    """The largest row group of a source: where it is, its rows and decoded bytes."""

    file: str
    index: int
    rows: int
    decoded_bytes: int
    columns: int


def largest_row_group(files: Iterable[str], columns: Sequence[str]) -> RowGroupSize | None:
    """Return the largest row group over ``files``, counting only ``columns`` (footers only).

    A group's decoded size is the larger of its column chunks' uncompressed sizes and 8 bytes
    per value (every value becomes a float64 or an int64 code when the site encodes it).
    ``None`` when the files hold no row group.
    """
    wanted = set(columns)
    best: RowGroupSize | None = None
    for path in files:
        try:
            meta = pq.ParquetFile(path).metadata
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"parquet file {path}: cannot read its footer "
                            f"({type(exc).__name__})") from None
        names = [meta.schema.column(j).path for j in range(meta.num_columns)]
        chosen = [j for j, name in enumerate(names) if name in wanted]
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            stored = sum(group.column(j).total_uncompressed_size for j in chosen)
            size = max(stored, 8 * group.num_rows * len(chosen))
            if best is None or size > best.decoded_bytes:
                best = RowGroupSize(path, i, group.num_rows, size, len(chosen))
    return best


def row_group_warning(group: RowGroupSize | None, limit: int | None = None) -> str | None:
    """Return a warning when the largest row group exceeds ``limit`` decoded bytes, else None.

    ``limit`` defaults to :data:`WARN_ROW_GROUP_BYTES`.
    """
    if group is None or group.decoded_bytes <= (WARN_ROW_GROUP_BYTES if limit is None
                                                else limit):
        return None
    per_row = max(1, group.decoded_bytes // max(1, group.rows))
    rows = max(1, SUGGESTED_ROW_GROUP_BYTES // per_row)
    return (f"{group.file}: row group {group.index} holds {group.rows:,} rows of "
            f"{group.columns} columns, {group.decoded_bytes / 2 ** 20:,.0f} MiB decoded; Arrow "
            "decodes a whole row group before reading it, and needed 1.5-7x that much memory in "
            f"our measurements. Rewrite the file with row groups of about {rows:,} rows "
            f"(~{SUGGESTED_ROW_GROUP_BYTES // 2 ** 20} MiB), e.g. pyarrow.parquet.write_table("
            f"table, path, row_group_size={rows}) or DuckDB COPY ... (ROW_GROUP_SIZE {rows})")
