"""``dpfed-site check`` warns when a Parquet row group is too big to read in bounded memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpfed.common.data import parquet_row_groups
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.parquet_row_groups import row_group_warning
from dpfed.common.data.schema import Schema
from dpfed.site_agent.cli import main
from tests.support.site_files import check_site


def write_table(path: Path, row_groups: list[int]) -> None:
    """A Parquet file with the schema's two columns plus a wide unused one, in these groups."""
    n = sum(row_groups)
    rng = np.random.default_rng(3)
    table = pa.table({"age": rng.uniform(0, 110, n), "ward": ["a", "b"] * (n // 2),
                      "notes": ["x" * 200] * n})
    with pq.ParquetWriter(path, table.schema) as writer:
        start = 0
        for rows in row_groups:
            writer.write_table(table.slice(start, rows), row_group_size=rows)
            start += rows


def test_the_largest_group_is_found_from_the_schemas_columns_only(tmp_path: Path) -> None:
    schema = Schema.load(check_site(tmp_path, tmp_path / "data.parquet").parent / "schema.toml")
    write_table(tmp_path / "data.parquet", [1000, 5000, 2000])
    group = open_data_source(spec_from_path(tmp_path / "data.parquet"), schema
                             ).largest_row_group()
    assert group is not None and (group.index, group.rows, group.columns) == (1, 5000, 2)
    # two columns at 8 bytes a value at least; the unused 200-byte text column not counted
    assert 16 * 5000 <= group.decoded_bytes < 40 * 5000
    warning = row_group_warning(group, limit=16 * 5000 - 1)
    assert warning is not None and "row group 1 holds 5,000 rows of 2 columns" in warning
    assert "row_group_size=" in warning
    assert row_group_warning(group, limit=group.decoded_bytes) is None
    # a dataset directory: every file's footer
    (tmp_path / "ds").mkdir()
    write_table(tmp_path / "ds" / "a.parquet", [300])
    write_table(tmp_path / "ds" / "b.parquet", [100, 700])
    group = open_data_source(spec_from_path(tmp_path / "ds"), schema).largest_row_group()
    assert group is not None and group.file.endswith("b.parquet") and group.rows == 700
    # other kinds decode no whole unit
    (tmp_path / "data.csv").write_text("age,ward\n40,a\n")
    assert open_data_source(spec_from_path(tmp_path / "data.csv"), schema
                            ).largest_row_group() is None


def test_check_prints_the_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    write_table(tmp_path / "data.parquet", [4000])
    config = check_site(tmp_path, tmp_path / "data.parquet")
    main(["check", "--config", str(config), "--timeout", "1"])
    out = capsys.readouterr().out
    assert "ok      data:" in out and "row group" not in out  # 4000 rows: far below 256 MiB
    monkeypatch.setattr(parquet_row_groups, "WARN_ROW_GROUP_BYTES", 1000)
    main(["check", "--config", str(config), "--timeout", "1"])
    out = capsys.readouterr().out
    assert "warning data: " in out and "row group 0 holds 4,000 rows" in out
    assert "ok      data:" in out  # a warning, not a failure
