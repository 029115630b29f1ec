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


CENTRE = np.array([0.2, -0.1, 0.7, 0.3])  # the DP centre in the scaled space


def make_result() -> PCAResult:
    comps = np.linalg.qr(np.random.default_rng(0).standard_normal((4, 2)))[0].T
    return PCAResult(comps, np.array([0.5, 0.1]), np.array([0.6, 0.12]),
                     ("age", "bmi", "ward=a", "ward=b"),
                     {"job_id": "j", "epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.2,
                      "centering": "mean", "schema_toml": SCHEMA.to_toml(),
                      "sites": [{"site_id": "a", "n_rows": 200}, {"site_id": "b", "n_rows": 100}],
                      "n_rows_total": 300},
                     np.array([0.5, 0.1, 0.01]), CENTRE)


def test_round_trip_and_plain_numpy_layout(tmp_path: Path) -> None:
    result = make_result()
    path = result.save(tmp_path / "out" / "pca.npz")
    with np.load(path, allow_pickle=False) as f:
        assert set(f.files) >= {"components", "eigenvalues", "feature_names", "metadata"}
        assert f["components"].shape == (2, 4)
    again = PCAResult.load(path)
    np.testing.assert_array_equal(again.components_, result.components_)
    np.testing.assert_array_equal(again.spectrum_, result.spectrum_)
    np.testing.assert_array_equal(again.mean_, result.mean_)
    assert again.feature_names_in_ == result.feature_names_in_
    assert again.metadata == result.metadata and again.n_components_ == 2
    assert again.schema == SCHEMA


def test_transform_applies_the_jobs_scaling_and_centring() -> None:
    result = make_result()
    df = pd.DataFrame({"age": [50.0, 100.0, 0.0], "bmi": [30.0, 10.0, 50.0],
                       "ward": ["a", "b", "a"]})
    enc, _ = encode_table(SCHEMA, df)
    u = UnitBallMap(SCHEMA).scaled(enc)
    z = (u - CENTRE) / 1.2  # centred at the DP centre, divided by the clip radius, not clipped
    np.testing.assert_allclose(result.transform(df), z @ result.components_.T)
    # The same rows as a numpy array in raw units give the same scores, never silently other.
    raw = np.array([[50.0, 30.0, 1, 0], [100.0, 10.0, 0, 1], [0.0, 50.0, 1, 0]])
    np.testing.assert_allclose(result.transform(raw), result.transform(df))
    # The unit-ball space is an explicit option.
    np.testing.assert_allclose(result.transform(z, space="unit"), z @ result.components_.T)
    with pytest.raises(ValidationError, match=r"shape \(n, 4\)"):
        result.transform(np.zeros((2, 5)))
    with pytest.raises(ValidationError, match="finite"):
        result.transform(np.full((1, 4), np.nan))
    with pytest.raises(ValidationError, match="space"):
        result.transform(raw, space="scaled")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="invalid"):
        result.transform(df.assign(ward=["a", "zzz", "b"]))


def test_numpy_in_the_schemas_column_order_when_no_column_is_nominal() -> None:
    schema = Schema.from_toml(SCHEMA.to_toml().split("[[columns]]\nname = \"ward\"")[0])
    comps = np.linalg.qr(np.random.default_rng(1).standard_normal((2, 2)))[0].T[:1]
    result = PCAResult(comps, np.array([0.3]), np.array([0.9]), ("age", "bmi"),
                       {"schema_toml": schema.to_toml(), "clip_norm": 0.5,
                        "centering": "mean"}, np.array([0.3, 0.03]), np.array([0.1, -0.2]))
    raw = np.array([[40.0, 20.0], [70.0, 35.0]])
    df = pd.DataFrame(raw, columns=["age", "bmi"])
    np.testing.assert_allclose(result.transform(raw), result.transform(df))


def test_mean_and_inverse_transform_are_in_raw_units() -> None:
    result = make_result()
    # age [0, 100] -> mid 50, half 50; bmi [10, 50] -> 30, 20; one-hots as shares
    np.testing.assert_allclose(result.mean_, [50 + 50 * 0.2, 30 - 20 * 0.1, 0.7, 0.3])
    raw = np.array([[50.0, 30.0, 1, 0], [100.0, 10.0, 0, 1]])
    scores = result.transform(raw)
    back = result.inverse_transform(scores)
    # the reconstruction is the projection onto mean_ + span(components) in raw units
    scale = np.array([50.0, 20.0, 1, 1])
    z = (raw - result.mean_) / scale / 1.2
    proj = (z @ result.components_.T) @ result.components_
    np.testing.assert_allclose(back, result.mean_ + proj * 1.2 * scale)
    np.testing.assert_allclose(result.transform(back), scores)  # idempotent on the span
    np.testing.assert_allclose(result.inverse_transform(scores, space="unit"), proj)
    with pytest.raises(ValidationError, match=r"shape \(n, 2\)"):
        result.inverse_transform(np.zeros((1, 3)))


def test_sklearn_attributes_and_repr() -> None:
    result = make_result()
    assert result.n_features_in_ == 4 and result.n_components_ == 2
    assert list(result.get_feature_names_out()) == ["pca0", "pca1"]
    text = repr(result)
    for part in ("n_components=2", "centering='mean'", "epsilon=1.0", "delta=1e-05", "sites=2",
                 "rows=300"):
        assert part in text
    uncentred = PCAResult(result.components_, result.explained_variance_,
                          result.explained_variance_ratio_, result.feature_names_in_,
                          {**result.metadata, "centering": "none"})
    np.testing.assert_allclose(uncentred.mean_, [50, 30, 0, 0])  # the schema midpoints


def test_explained_variance_is_the_variance_of_the_scores_when_centred() -> None:
    """sklearn's contract: explained_variance_[k] = variance of transform(X)[:, k]."""
    rng = np.random.default_rng(2)
    n = 5000
    age = rng.normal(50, 15, n).clip(0, 100)
    bmi = (0.2 * age + rng.normal(20, 3, n)).clip(10, 50)
    ward = rng.choice(["a", "b"], n, p=[0.7, 0.3])
    df = pd.DataFrame({"age": age, "bmi": bmi, "ward": ward})
    u = UnitBallMap(SCHEMA).scaled(encode_table(SCHEMA, df)[0])
    mu = u.mean(axis=0)
    c = 0.8
    cov = np.cov((u - mu) / c, rowvar=False, bias=True)
    values, vectors = np.linalg.eigh(cov)
    comps = vectors[:, ::-1][:, :2].T
    result = PCAResult(comps, values[::-1][:2], values[::-1][:2] / values.sum(),
                       ("age", "bmi", "ward=a", "ward=b"),
                       {"schema_toml": SCHEMA.to_toml(), "clip_norm": c, "centering": "mean"},
                       values[::-1], mu)
    scores = result.transform(df)
    np.testing.assert_allclose(scores.var(axis=0), result.explained_variance_, rtol=1e-9)
    np.testing.assert_allclose(scores.mean(axis=0), 0, atol=1e-12)


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such result file"):
        PCAResult.load(tmp_path / "nope.npz")


def test_not_a_result_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.npz"
    np.savez(bad, something=np.ones(2))
    with pytest.raises(ValidationError, match="not a pca result file"):
        PCAResult.load(bad)
    (tmp_path / "y.npz").write_bytes(b"garbage")
    with pytest.raises(ValidationError, match="not a dpfed result file"):
        PCAResult.load(tmp_path / "y.npz")
