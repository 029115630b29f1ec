"""A directory of Parquet files (Hive-partitioned) as one site table; the feature map's passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpfed.common.data.data_sources import open_data_source, read_all, spec_from_path
from dpfed.common.data.encoding import RowPolicy, encode_table
from dpfed.common.data.parquet_dataset import ParquetDatasetSource
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError
from dpfed.common.pca.centring import centre_rows
from dpfed.common.pca.features import UnitBallMap
from tests.common.data.test_missing_dates_other import ROWS
from tests.common.data.test_missing_dates_other import SCHEMA as MISSING_SCHEMA

SCHEMA = Schema.from_toml("""
[[columns]]
name = "x"
type = "continuous"
min = -10
max = 10

[[columns]]
name = "ward"
type = "nominal"
categories = ["a", "b", "c"]

[[columns]]
name = "year"
type = "ordinal"
levels = [2020, 2021]
""")


def write_dataset(root: Path, rows: int = 3000) -> pd.DataFrame:
    rng = np.random.default_rng(4)
    frames = []
    for year in (2020, 2021):
        for part in range(3):
            frame = pd.DataFrame({"x": rng.uniform(-9, 9, rows // 6),
                                  "ward": rng.choice(["a", "b", "c"], rows // 6)})
            folder = root / f"year={year}"
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pandas(frame, preserve_index=False),
                           folder / f"part-{part}.parquet", row_group_size=77)
            frames.append(frame.assign(year=str(year)))
    (root / "_SUCCESS").write_text("")  # writers leave marker files: they are not data
    return pd.concat(frames, ignore_index=True)


@pytest.mark.parametrize("chunk_rows", [50, 1000, 65536])
def test_a_partitioned_directory_reads_as_one_table_in_file_order(tmp_path: Path,
                                                                  chunk_rows: int) -> None:
    expected = write_dataset(tmp_path / "d")
    source = open_data_source(spec_from_path(tmp_path / "d", chunk_rows=chunk_rows), SCHEMA)
    assert isinstance(source, ParquetDatasetSource) and len(source.files) == 6
    assert "parquet dataset" in source.describe() and "6 files" in source.describe()
    chunks = list(source.iter_chunks())
    assert max(r.rows_read for _, r in chunks) <= chunk_rows
    table, report = read_all(source)
    assert report.rows_read == report.rows_kept == len(expected)
    frame = table.to_frame()
    np.testing.assert_array_equal(frame["x"], expected["x"])
    assert frame["ward"].astype(str).tolist() == expected["ward"].tolist()
    assert frame["year"].astype(str).tolist() == expected["year"].tolist()


def test_dataset_errors_name_the_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no Parquet file"):
        open_data_source(spec_from_path(empty), SCHEMA)
    write_dataset(tmp_path / "d")
    with pytest.raises(DataError, match=r"has no column\(s\) \['age'\].*partition keys"):
        open_data_source(spec_from_path(tmp_path / "d"),
                         Schema.from_toml("[[columns]]\nname='age'\ntype='continuous'\n"
                                          "min=0\nmax=1"))
    (tmp_path / "d" / "year=2021" / "part-1.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(DataError, match="cannot be read"):
        read_all(open_data_source(spec_from_path(tmp_path / "d"), SCHEMA))


def test_column_sums_and_centred_equal_the_matrix_path() -> None:
    enc, _ = encode_table(MISSING_SCHEMA, ROWS)
    fmap = UnitBallMap(MISSING_SCHEMA)
    np.testing.assert_allclose(fmap.column_sums(enc), fmap.scaled(enc).sum(axis=0),
                               rtol=1e-12, atol=1e-12)
    rng = np.random.default_rng(1)
    for clip in (0.5, 1.5, None):
        clipped = UnitBallMap(MISSING_SCHEMA, clip_norm=clip)
        center = rng.uniform(-0.5, 0.5, clipped.n_features)
        reference, n_ref = centre_rows(clipped.scaled(enc).copy(), center, clipped)
        fused, n_fused = clipped.centred(enc, center)
        np.testing.assert_allclose(fused, reference, rtol=1e-12, atol=1e-12)
        assert n_fused == n_ref
        assert np.max(np.linalg.norm(fused, axis=1)) <= 1 + 1e-12


def test_reused_matrices_are_never_shared_while_referenced() -> None:
    frame = pd.DataFrame({"x": np.linspace(-5, 5, 400), "ward": ["a"] * 400,
                          "year": ["2020"] * 400})
    enc, _ = encode_table(SCHEMA, frame, policy=RowPolicy())
    fmap = UnitBallMap(SCHEMA)
    first = fmap.scaled(enc)
    second = fmap.scaled(enc)
    assert not np.shares_memory(first, second)
    view = second[:, :2]  # a view keeps its buffer referenced
    del second
    third = fmap.scaled(enc)
    assert not np.shares_memory(third, view) and not np.shares_memory(third, first)
    kept = first.copy()
    del first
    fourth = fmap.scaled(enc)  # the first buffer is free again: reused, and right
    np.testing.assert_array_equal(fourth, kept)
    assert fourth.flags.f_contiguous and fourth.shape == (400, fmap.n_features)
