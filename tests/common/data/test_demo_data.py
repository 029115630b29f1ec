"""Demo data: schema-valid, reproducible, hospital-flavoured, with a real factor structure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, read_all, spec_from_path
from dpfed.common.data.demo_data import (
    GENERATION_BLOCK_ROWS,
    demo_model,
    generate_demo,
    write_demo,
)
from dpfed.common.data.encoding import RowPolicy, encode_table
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import UnitBallMap

STRICT = RowPolicy(missing="error", invalid="error", out_of_range="error")


def column_arrays(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """Floats, or category codes (pandas compares categoricals element by element, slowly)."""
    return {name: (frame[name].cat.codes.to_numpy() if isinstance(
        frame[name].dtype, pd.CategoricalDtype) else frame[name].to_numpy())
            for name in frame.columns}


def assert_same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns)
    for name, values in column_arrays(a).items():
        np.testing.assert_array_equal(values, column_arrays(b)[name], err_msg=name)
        assert a[name].dtype == b[name].dtype, name


@pytest.mark.parametrize("mixed", [False, True])
def test_rows_respect_the_schema(mixed: bool) -> None:
    schema, frames = generate_demo(3, 5000, 25, seed=11, mixed=mixed)
    assert len(frames) == 3 and len(schema.columns) == 25
    assert schema.names[:3] == ("age", "bmi", "systolic_bp")
    assert "lab_001" in schema.names
    for frame in frames:
        assert list(frame.columns) == list(schema.names) and len(frame) == 5000
        # Strict policy: any missing, invalid or out-of-range value would raise.
        table, report = encode_table(schema, frame, policy=STRICT)
        assert report.rows_kept == 5000 and report.values_clipped == 0
        for col in schema.of_type("continuous"):
            assert isinstance(col, ContinuousColumn)
            values = table.columns[col.name]
            assert col.min <= values.min() and values.max() <= col.max
    if mixed:
        assert {c.type for c in schema.columns} == {"continuous", "ordinal", "nominal"}
        assert schema.column("severity").type == "ordinal"
        assert schema.column("ward").type == "nominal"
        frame = frames[0]
        assert frame["severity"].cat.ordered and not frame["ward"].cat.ordered
        for col in schema.columns:
            if col.type != "continuous":
                # Every level/category occurs: the links are not degenerate.
                assert frame[col.name].value_counts().min() > 0, col.name


def test_reproducible_from_seed_and_independent_of_site_count() -> None:
    schema_a, a = generate_demo(2, 3000, 12, seed=7, mixed=True)
    schema_b, b = generate_demo(3, 3000, 12, seed=7, mixed=True)
    assert schema_a == schema_b
    for x, y in zip(a, b[:2], strict=True):
        assert_same_rows(x, y)
    _, c = generate_demo(2, 3000, 12, seed=8, mixed=True)
    assert not np.allclose(a[0]["glucose"], c[0]["glucose"])
    assert not np.allclose(a[0]["age"], a[1]["age"])  # sites differ


def test_second_moment_has_a_clear_spectral_gap() -> None:
    p = 30
    model = demo_model(p, seed=3)
    k = model.n_factors
    assert k == 5 and np.all(np.diff(model.factor_sd) < 0)  # decaying spectrum
    schema, frames = generate_demo(1, 20000, p, seed=3)
    table, _ = encode_table(schema, frames[0])
    x, _ = UnitBallMap(schema).transform(table)
    eigenvalues = np.linalg.eigvalsh(x.T @ x / len(x))[::-1]
    # The uncentred second moment has k factor directions plus the mean's direction: a
    # clear drop after k + 1 eigenvalues, and a flat noise floor after it.
    ratios = eigenvalues[:-1] / eigenvalues[1:]
    assert ratios[k] > 4.0, ratios[:k + 3]
    assert ratios[k] > 2.0 * ratios[k + 1:].max()
    # Centred (covariance): the drop is after exactly k.
    xc = x - x.mean(axis=0)
    centred = np.linalg.eigvalsh(xc.T @ xc / len(x))[::-1]
    assert centred[k - 1] / centred[k] > 4.0


def test_sites_share_loadings_but_differ_in_means() -> None:
    schema, frames = generate_demo(2, 20000, 30, seed=5)
    names = [c.name for c in schema.of_type("continuous")]
    a, b = (f[names].to_numpy() for f in frames)
    standard_error = np.sqrt(a.var(axis=0) / len(a) + b.var(axis=0) / len(b))
    z = np.abs(a.mean(axis=0) - b.mean(axis=0)) / standard_error
    assert np.median(z) > 5.0  # hospital heterogeneity, far beyond sampling noise
    # Shared loadings: the same correlation structure up to sampling error.
    diff = np.abs(np.corrcoef(a.T) - np.corrcoef(b.T))
    assert diff.max() < 0.06


def test_categorical_columns_are_driven_by_the_factors() -> None:
    schema, frames = generate_demo(1, 10000, 30, seed=5, mixed=True)
    frame = frames[0]
    continuous = [c.name for c in schema.of_type("continuous")]
    design = np.column_stack([np.ones(len(frame))] + [frame[c].to_numpy() for c in continuous])
    basis = np.linalg.qr(design)[0]  # least squares fits are projections onto its columns

    def r_squared(y: np.ndarray) -> float:
        return float(1.0 - (y - basis @ (basis.T @ y)).var() / y.var())

    for col in schema.of_type("ordinal"):
        codes = frame[col.name].cat.codes.to_numpy().astype(float)
        assert r_squared(codes) > 0.4, col.name
    for col in schema.of_type("nominal"):
        codes = frame[col.name].cat.codes.to_numpy()
        best = max(r_squared((codes == i).astype(float)) for i in range(codes.max() + 1))
        assert best > 0.2, col.name
    # Independent columns would give R^2 ~ p/n = 0.002: check the test can fail.
    rng = np.random.default_rng(0)
    assert r_squared(rng.integers(0, 3, len(frame)).astype(float)) < 0.01


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_written_files_read_back_equal_to_generated_frames(tmp_path: Path, fmt: str) -> None:
    rows = GENERATION_BLOCK_ROWS + 1000  # more than one generation block
    schema_path, paths = write_demo(tmp_path / "demo", 2, rows, 6, seed=4, mixed=True,
                                    fmt=fmt)
    assert schema_path == tmp_path / "demo" / "schema.toml"
    assert [p.name for p in paths] == [f"site_01.{fmt}", f"site_02.{fmt}"]
    schema = Schema.load(schema_path)
    expected_schema, frames = generate_demo(2, rows, 6, seed=4, mixed=True)
    assert schema == expected_schema
    for path, frame in zip(paths, frames, strict=True):
        table, report = read_all(open_data_source(spec_from_path(path), schema))
        assert report.rows_read == report.rows_kept == rows
        assert_same_rows(table.to_frame(), frame)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: generate_demo(0, 10, 5, seed=1), "n_sites must be >= 1"),
    (lambda: generate_demo(1, 0, 5, seed=1), "rows_per_site must be >= 1"),
    (lambda: generate_demo(1, 10, 2, seed=1, mixed=True), "n_features must be >= 3"),
    (lambda: generate_demo(1, 10, 5, seed=-1), "seed must be >= 0"),
    (lambda: generate_demo(1, 10, 5, seed=1, n_factors=9), "n_factors must be <= 5"),
    (lambda: write_demo("/nonexistent/x", 1, 10, 5, seed=1, fmt="xlsx"), "fmt must be one of"),
])
def test_invalid_arguments(call: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        call()  # type: ignore[operator]
