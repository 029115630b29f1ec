"""The analyst's PCAResult: file format, loading, transform with the sites' public scaling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.pca_result import PCAResult
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.pca.features import UnitBallMap

SCHEMA = Schema.from_toml("""
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 100
[[columns]]
name = "bmi"
type = "continuous"
min = 10
max = 50
[[columns]]
name = "ward"
type = "nominal"
categories = ["a", "b"]
""")


def make_result() -> PCAResult:
    comps = np.linalg.qr(np.random.default_rng(0).standard_normal((4, 2)))[0].T
    return PCAResult(comps, np.array([0.5, 0.1]), np.array([0.6, 0.12]),
                     ("age", "bmi", "ward=a", "ward=b"),
                     {"job_id": "j", "epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.2,
                      "schema_toml": SCHEMA.to_toml(), "sites": []},
                     np.array([0.5, 0.1, 0.01]))


def test_round_trip_and_plain_numpy_layout(tmp_path: Path) -> None:
    result = make_result()
    path = result.save(tmp_path / "out" / "pca.npz")
    with np.load(path, allow_pickle=False) as f:
        assert set(f.files) >= {"components", "eigenvalues", "feature_names", "metadata"}
        assert f["components"].shape == (2, 4)
    again = PCAResult.load(path)
    np.testing.assert_array_equal(again.components_, result.components_)
    np.testing.assert_array_equal(again.spectrum_, result.spectrum_)
    assert again.feature_names_in_ == result.feature_names_in_
    assert again.metadata == result.metadata and again.n_components_ == 2
    assert again.schema == SCHEMA


def test_transform_applies_the_public_scaling() -> None:
    result = make_result()
    df = pd.DataFrame({"age": [50.0, 100.0, 0.0], "bmi": [30.0, 10.0, 50.0],
                       "ward": ["a", "b", "a"]})
    enc, _ = encode_table(SCHEMA, df)
    features, _ = UnitBallMap(SCHEMA, 1.2).transform(enc)
    np.testing.assert_allclose(result.transform(df), features @ result.components_.T)
    np.testing.assert_allclose(result.transform(features), features @ result.components_.T)
    with pytest.raises(ValidationError, match=r"shape \(n, 4\)"):
        result.transform(np.zeros((2, 3)))
    with pytest.raises(DataError, match="invalid"):
        result.transform(df.assign(ward=["a", "zzz", "b"]))


def test_not_a_result_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.npz"
    np.savez(bad, something=np.ones(2))
    with pytest.raises(ValidationError, match="not a pca result file"):
        PCAResult.load(bad)
    (tmp_path / "y.npz").write_bytes(b"garbage")
    with pytest.raises(ValidationError, match="not a dpfed result file"):
        PCAResult.load(tmp_path / "y.npz")
