"""DPdisPCA building blocks: unit-ball map, Gram accumulation, site release, combination."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.dppca import (
    GramAccumulator,
    captured_energy,
    combine,
    pca_mechanism,
    site_cost,
    site_release,
    top_components,
)
from dpfed.common.pca.features import UnitBallMap, feature_names
from dpfed.common.privacy.mechanisms import gaussian_sigma

SCHEMA = Schema.from_toml("""
[[columns]]
name = "a"
type = "continuous"
min = -10
max = 10
[[columns]]
name = "b"
type = "continuous"
min = 0
max = 4
[[columns]]
name = "lvl"
type = "ordinal"
levels = ["x", "y", "z"]
[[columns]]
name = "cat"
type = "nominal"
categories = ["p", "q"]
""")


def _table(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"a": rng.uniform(-10, 10, n), "b": rng.uniform(0, 4, n),
                         "lvl": rng.choice(["x", "y", "z"], n), "cat": rng.choice(["p", "q"], n)})


def test_unit_ball_map_uses_only_the_schema() -> None:
    enc, _ = encode_table(SCHEMA, _table(500))
    ub = UnitBallMap(SCHEMA)
    assert ub.names == feature_names(SCHEMA) == ("a", "b", "lvl", "cat=p", "cat=q")
    x, clipped = ub.transform(enc)
    assert clipped == 0  # default clip norm = max possible norm
    assert np.all(np.linalg.norm(x, axis=1) <= 1 + 1e-12)
    # Scaling is by declared bounds: the extreme value 10 of "a" maps to 1/norm.
    extreme = pd.DataFrame({"a": [10.0], "b": [2.0], "lvl": ["y"], "cat": ["q"]})
    e, _ = encode_table(SCHEMA, extreme)
    xe, _ = ub.transform(e)
    np.testing.assert_allclose(xe[0] * ub.norm, [1.0, 0.0, 0.0, 0.0, 1.0])
    tight = UnitBallMap(SCHEMA, clip_norm=0.5)
    xt, n_clipped = tight.transform(enc)
    assert n_clipped > 0 and np.all(np.linalg.norm(xt, axis=1) <= 1 + 1e-12)


def test_gram_accumulator_matches_dense_product_over_chunks() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1003, 7))
    acc = GramAccumulator(7)
    for i in range(0, 1003, 100):
        acc.add(x[i:i + 100])
    acc.add(x[:0])
    np.testing.assert_allclose(acc.gram(), x.T @ x, rtol=1e-12, atol=1e-10)
    assert acc.n_rows == 1003
    with pytest.raises(ValidationError, match="shape"):
        acc.add(np.zeros((3, 6)))


def test_pca_mechanism_is_calibrated_to_replace_one() -> None:
    """sqrt(2)/N on the upper triangle of G/N (the worst case is searched in
    tests/common/privacy/test_sensitivity_search.py)."""
    n = 200
    mech = pca_mechanism(n, 1.0, 1e-5)
    assert mech.sensitivity == pytest.approx(np.sqrt(2.0) / n)
    assert mech.sigma == pytest.approx(gaussian_sigma(1.0, 1e-5) * np.sqrt(2.0) / n)
    assert site_cost(n, 1.0, 1e-5).rho == pytest.approx(
        1 / (2 * gaussian_sigma(1.0, 1e-5) ** 2))
    classic = pca_mechanism(n, 0.5, 1e-5, "classic")
    assert classic.sigma == pytest.approx(
        np.sqrt(2.0) * np.sqrt(2 * np.log(1.25 / 1e-5)) / (n * 0.5))


def test_site_release_shape_and_psd_factor() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((400, 12)) / 4
    g = x.T @ x
    out = site_release(g, 400, epsilon=1.0, delta=1e-5, rank=6, rng=rng)
    assert out.factor.shape == (12, 6) and out.n_rows == 400
    assert np.all(np.isfinite(out.factor))
    with pytest.raises(ValidationError, match="rank"):
        site_release(g, 400, epsilon=1.0, delta=1e-5, rank=13, rng=rng)
    with pytest.raises(ValidationError, match="not differentially private"):
        site_release(g, 400, epsilon=10.0, delta=1e-5, rank=2, rng=rng, calibration="classic")


def test_combine_equals_dense_average_of_factors() -> None:
    rng = np.random.default_rng(4)
    factors = [rng.standard_normal((9, 4)) for _ in range(3)]
    est = combine(factors, 3)
    a_c = sum(f @ f.T for f in factors) / 3
    values, vectors = np.linalg.eigh(a_c)
    np.testing.assert_allclose(est.eigenvalues, values[::-1][:3], rtol=1e-10)
    np.testing.assert_allclose(np.abs(est.components @ vectors[:, ::-1][:, :3]), np.eye(3),
                               atol=1e-8)
    np.testing.assert_allclose(est.components @ est.components.T, np.eye(3), atol=1e-12)
    assert est.total_variance == pytest.approx(np.trace(a_c))
    assert np.all(est.explained_variance_ratio <= 1)
    # Deterministic sign: largest |loading| positive.
    assert np.all(est.components[np.arange(3), np.argmax(np.abs(est.components), 1)] > 0)


def test_high_privacy_limit_recovers_pooled_subspace() -> None:
    """With a huge epsilon the DP subspace captures (almost) all the non-private energy."""
    rng = np.random.default_rng(5)
    p, k = 15, 3
    basis = np.linalg.qr(rng.standard_normal((p, p)))[0]
    scales = np.r_[3.0, 2.0, 1.5, np.full(p - 3, 0.1)]
    sites = []
    for _ in range(3):
        x = (rng.standard_normal((2000, p)) * scales) @ basis.T
        sites.append(x / np.linalg.norm(x, axis=1).max())
    a = sum(s.T @ s / len(s) for s in sites) / 3
    factors = [site_release(s.T @ s, len(s), epsilon=1e6, delta=1e-5, rank=2 * k, rng=rng).factor
               for s in sites]
    est = combine(factors, k)
    ratio = captured_energy(est.components, a) / captured_energy(top_components(a, k), a)
    assert ratio > 0.999
    # At a small epsilon the same data gives a clearly worse subspace (the noise is real).
    noisy = [site_release(s.T @ s, len(s), epsilon=0.05, delta=1e-5, rank=2 * k, rng=rng).factor
             for s in sites]
    low = captured_energy(combine(noisy, k).components, a) / captured_energy(
        top_components(a, k), a)
    assert low < 0.99
