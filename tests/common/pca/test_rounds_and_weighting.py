"""Coordinator-side steps of the pca rounds: DP mean, DP quantile, budget split, site weighting."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.job_choices import parse_clip_norm
from dpfed.common.job_params import MEAN_SHARE, NORMS_SHARE, PCAParams
from dpfed.common.pca.centring import dp_mean
from dpfed.common.pca.clipping import (
    GRID_STEPS_PER_OCTAVE,
    dp_quantile,
    norm_grid,
    norm_histogram,
    norm_histogram_mechanism,
)
from dpfed.common.pca.dppca import captured_energy, combine, site_weights, top_components
from tests.support.schemas import continuous

TEN = continuous(10)


def test_norm_grid_is_public_and_geometric() -> None:
    edges = norm_grid(4.0)
    assert edges[-1] == 4.0 and np.all(np.diff(edges) > 0)
    np.testing.assert_allclose(edges[1:] / edges[:-1], 2 ** (1 / GRID_STEPS_PER_OCTAVE))
    counts = norm_histogram(np.array([0.0, edges[0], edges[0] * 1.01, 4.0, 99.0]), edges)
    assert counts[0] == 2 and counts[1] == 1 and counts[-1] == 2 and counts.sum() == 5


def test_dp_quantile_without_noise_is_one_grid_step_above_the_exact_quantile() -> None:
    rng = np.random.default_rng(0)
    edges = norm_grid(10.0)
    norms = [rng.gamma(4.0, 0.3, 3000), rng.gamma(2.0, 0.5, 1000)]
    hists = [norm_histogram(n, edges) for n in norms]
    pooled = np.concatenate(norms)
    for q in (0.5, 0.9, 0.99):
        radius = dp_quantile(hists, edges, q, len(pooled))
        exact = np.quantile(pooled, q)
        assert exact <= radius * (1 + 1e-12) <= exact * 2 ** (1 / GRID_STEPS_PER_OCTAVE) * 1.0001
        assert np.mean(pooled <= radius) >= q
    assert dp_quantile(hists, edges, 1.0, len(pooled)) >= pooled.max()


def test_dp_quantile_with_real_noise_is_accurate_at_hospital_sizes() -> None:
    """At eps = 0.1 for the round and 3 x 20,000 rows the chosen radius stays within a step."""
    rng = np.random.default_rng(1)
    edges = norm_grid(2 * np.sqrt(20))
    norms = [np.abs(rng.normal(1.5, 0.4, 20_000)) for _ in range(3)]
    mech = norm_histogram_mechanism(0.1, 1e-6)
    exact = np.quantile(np.concatenate(norms), 0.9)
    step = 2 ** (1 / GRID_STEPS_PER_OCTAVE)
    for _ in range(20):
        radius = dp_quantile([mech.release(norm_histogram(n, edges), rng) for n in norms],
                             edges, 0.9, 60_000)
        assert exact / step <= radius <= exact * step ** 2
    # Cost: one Gaussian release of sensitivity sqrt(2) at the round's share.
    assert mech.cost().epsilon == 0.1 and mech.cost().sensitivity == pytest.approx(np.sqrt(2))


def test_dp_quantile_rejects_hostile_histograms() -> None:
    edges = norm_grid(1.0)
    with pytest.raises(ValidationError, match="finite"):
        dp_quantile([np.full(len(edges), np.nan)], edges, 0.9, 10)
    with pytest.raises(ValidationError, match="bins"):
        dp_quantile([np.zeros(3)], edges, 0.9, 10)
    # noisy counts that never reach q N: the worst-case bound, never something smaller
    assert dp_quantile([np.full(len(edges), -1e9)], edges, 0.9, 10) == edges[-1]


def test_dp_mean_projects_into_the_box_and_the_ball() -> None:
    bound = 2.0
    mu = dp_mean([np.array([10.0, -10.0, 0.1, 0.0])], 4, bound)
    assert np.all(np.abs(mu) <= 1) and np.linalg.norm(mu) <= bound + 1e-12
    exact = dp_mean([np.array([0.4, -0.2, 0.0, 0.2]), np.array([0.2, 0.2, 0.2, 0.0])], 2, bound)
    np.testing.assert_allclose(exact, [0.6, 0.0, 0.2, 0.2])
    with pytest.raises(ValidationError, match="finite"):
        dp_mean([np.array([np.inf, 0.0])], 2, bound)


def test_rounds_split_the_job_budget_and_sum_to_it() -> None:
    cases = {("mean", "auto"): ["mean", "norms", "pca"], ("mean", 1.0): ["mean", "pca"],
             ("none", "auto"): ["norms", "pca"], ("none", None): ["pca"]}
    for (centering, clip), names in cases.items():
        params = PCAParams(3, 6, clip_norm=clip, centering=centering)
        rounds = [(r.name, r.epsilon, r.delta) for r in params.shares(2.0, 1e-5)]
        assert [r[0] for r in rounds] == names
        assert sum(r[1] for r in rounds) == pytest.approx(2.0)
        assert sum(r[2] for r in rounds) == pytest.approx(1e-5)
        shares = {r[0]: r[1] / 2.0 for r in rounds}
        assert shares.get("mean", MEAN_SHARE) == pytest.approx(MEAN_SHARE)
        assert shares.get("norms", NORMS_SHARE) == pytest.approx(NORMS_SHARE)


def test_params_defaults_and_parsing() -> None:
    params = PCAParams.parse({"n_components": 3}, TEN)
    assert (params.rank, params.centering, params.clip_norm, params.site_weighting) == (
        6, "mean", "auto", "size")
    assert PCAParams.parse({"n_components": 6}, TEN).rank == 10  # min(2K, p)
    again = PCAParams.parse(params.to_mapping(), TEN)
    assert again == params
    schema = PCAParams.parse({"n_components": 3, "clip_norm": "schema"}, TEN)
    assert schema.clip_norm is None and schema.to_mapping()["clip_norm"] == "schema"
    for bad, match in [({"clip_norm": "big"}, "clip_norm"), ({"clip_norm": -1}, "clip_norm"),
                       ({"centering": "median"}, "centering"),
                       ({"site_weighting": "votes"}, "site_weighting"),
                       ({"clip_quantile": 0}, "clip_quantile"),
                       ({"clip_quantile": 1.5}, "clip_quantile")]:
        with pytest.raises(ValidationError, match=match):
            PCAParams.parse({"n_components": 2, **bad}, TEN)
    assert parse_clip_norm("auto") == "auto" and parse_clip_norm("2.5") == 2.5
    for bad_text in ("0", "-1", "nan", "inf", "big"):
        with pytest.raises(argparse.ArgumentTypeError, match="auto"):
            parse_clip_norm(bad_text)


def unequal_sites(rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    p = 8
    sites = []
    for n in (9000, 1000):
        basis = np.linalg.qr(rng.standard_normal((p, p)))[0][:, :2]
        sites.append((rng.standard_normal((n, 2)) * [0.5, 0.3]) @ basis.T)
    pooled = np.vstack(sites)
    return sites, pooled.T @ pooled / len(pooled)


def test_size_weighting_reproduces_pooled_pca_without_noise() -> None:
    sites, pooled = unequal_sites(np.random.default_rng(3))
    factors = []
    for x in sites:  # exact P_s with R = p: P_s P_s^T = G_s / N_s
        values, vectors = np.linalg.eigh(x.T @ x / len(x))
        factors.append(vectors * np.sqrt(np.clip(values, 0, None)))
    n = [len(x) for x in sites]
    size = combine(factors, 2, list(site_weights(n, "size")))
    equal = combine(factors, 2, list(site_weights(n, "equal")))
    assert combine(factors, 2).components == pytest.approx(equal.components)  # paper default
    exact = top_components(pooled, 2)
    q = captured_energy(exact, pooled)
    assert captured_energy(size.components, pooled) / q == pytest.approx(1.0, abs=1e-9)
    assert captured_energy(equal.components, pooled) / q < 0.9  # follows the small site
    assert size.total_variance == pytest.approx(np.trace(pooled))
    np.testing.assert_allclose(site_weights(n, "size"), [0.9, 0.1])
    with pytest.raises(ValidationError, match="weights"):
        combine(factors, 2, [1.0])
