"""The shared coordinator pipeline: size-weighted combine, projection, one code path.

Layers: exact (noise-free) identities; seeded statistical comparisons, each also run against a
deliberately broken copy that must fail the same check; the central synthesizer runs the very
functions the federated job runs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca import dppca
from dpfed.common.synth import factor_model as fm
from dpfed.common.synth.dp_marginals import proportions_from_counts
from dpfed.common.synth.factor_model import dp_second_moment
from dpfed.common.synth.generative import fit_factor_model
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    link_histogram_sensitivity,
    project_counts,
    split_proportions,
)
from dpfed.common.synth.links import clip_to_unit_ball
from dpfed.common.synth.pipeline import (
    aligned_latent,
    calibrated_links,
    combine_factors,
    links_from_histograms,
)

SCHEMA = Schema.from_dict({"columns": [
    {"name": "age", "type": "continuous", "min": 0, "max": 100},
    {"name": "cost", "type": "continuous", "min": 0, "max": 1000},
    {"name": "grade", "type": "ordinal", "levels": ["1", "2", "3", "4"]},
    {"name": "ward", "type": "nominal", "categories": ["a", "b", "c"]},
    {"name": "sex", "type": "nominal", "categories": ["f", "m"]},
]})
BINS = 16


def frame(n: int, seed: int, shift: float = 0.0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 2))
    a = z[:, 0] + shift
    return pd.DataFrame({
        "age": np.clip(50 + 15 * a, 0, 100),
        "cost": np.clip(np.exp(4 + 0.8 * (0.6 * a + 0.8 * z[:, 1])), 0, 1000),
        "grade": np.array(["1", "2", "3", "4"])[np.digitize(a + 0.5 * z[:, 1], [-1, 0, 1])],
        "ward": np.array(["a", "b", "c"])[np.digitize(z[:, 1], [-0.3, 0.8])],
        "sex": np.array(["f", "m"])[(a - z[:, 1] > 0).astype(int)],
    })


def exact_links(data: pd.DataFrame) -> tuple[np.ndarray, object]:
    table, _ = encode_table(SCHEMA, data)
    acc = LinkHistogramAccumulator(SCHEMA, BINS)
    acc.add(table)
    return links_from_histograms(acc.counts.astype(float), SCHEMA, BINS, n_rows=table.n_rows)


def exact_factor(gram_over_n: np.ndarray) -> np.ndarray:
    """Noise-free site factor ``P = U sqrt(Lambda)`` with ``P P^T = G / N``."""
    w, u = np.linalg.eigh(gram_over_n)
    return np.asarray(u * np.sqrt(np.clip(w, 0.0, None))[None, :])


# --------------------------------------------------------------------------- combine


def test_size_weighted_combine_is_the_pooled_second_moment() -> None:
    # Sites of very different sizes and populations (non-IID): the pooled second moment is
    # sum_s (N_s / N) G_s / N_s; equal weights (the broken copy) over-represent the small site.
    sites = [frame(4000, 1), frame(500, 2, shift=1.5)]
    _, links = exact_links(pd.concat(sites, ignore_index=True))
    rng = np.random.default_rng(3)
    grams, rows, units = [], [], []
    for data in sites:
        table, _ = encode_table(SCHEMA, data)
        unit, _ = clip_to_unit_ball(links.to_latent(table, rng), 2.0)  # type: ignore[attr-defined]
        units.append(unit)
        grams.append(unit.T @ unit / table.n_rows)
        rows.append(table.n_rows)
    pooled = np.vstack(units)
    target = pooled.T @ pooled / pooled.shape[0]
    dim = target.shape[0]
    factors = [exact_factor(g) for g in grams]
    est = combine_factors(factors, rows, dim)
    np.testing.assert_allclose(dp_second_moment(est, dim), target, atol=1e-10)
    broken = dppca.combine(factors, dim)  # equal weights
    assert float(np.abs(dp_second_moment(broken, dim) - target).max()) > 1e-2
    with pytest.raises(ValidationError, match="row counts"):
        combine_factors(factors, rows[:1], dim)


# --------------------------------------------------------------------------- projection


def test_projection_is_exact_without_noise() -> None:
    rng = np.random.default_rng(5)
    for _ in range(20):
        c = rng.integers(0, 50, 12).astype(float)
        c[rng.integers(0, 12, 4)] = 0.0
        np.testing.assert_allclose(project_counts(c, float(c.sum())), c, atol=1e-9)


def _mean_error(estimator: object, sigma: float, seed: int) -> float:
    """Mean L1 error of estimated proportions of a sparse (skewed) histogram."""
    rng = np.random.default_rng(seed)
    truth = np.r_[np.array([400.0, 900.0, 500.0, 150.0, 50.0]), np.zeros(11)]
    n = float(truth.sum())
    errors = []
    for _ in range(200):
        noisy = truth + rng.normal(0.0, sigma, truth.size)
        p = estimator(noisy, n)  # type: ignore[operator]
        errors.append(float(np.abs(p - truth / n).sum()))
    return float(np.mean(errors))


def test_projection_lowers_the_error_of_noisy_histograms_and_a_broken_copy_is_caught() -> None:
    def projected(c: np.ndarray, n: float) -> np.ndarray:
        return proportions_from_counts(project_counts(c, n), min_proportion=0.0)

    def clipped(c: np.ndarray, n: float) -> np.ndarray:  # the estimator before projection
        return proportions_from_counts(c, min_proportion=0.0)

    def broken(c: np.ndarray, n: float) -> np.ndarray:  # threshold with the wrong sign
        x = project_counts(c, n)
        t = float(np.mean(x - c))  # shifts up by the threshold instead of down
        return proportions_from_counts(np.clip(c + t, 0.0, None), min_proportion=0.0)

    for sigma in (30.0, 80.0):
        base = _mean_error(clipped, sigma, 9)
        assert _mean_error(projected, sigma, 9) < 0.75 * base, sigma
        assert _mean_error(broken, sigma, 9) > 0.9 * base, sigma


# --------------------------------------------------------------------------- one code path


def test_central_synthesizer_runs_the_job_pipeline() -> None:
    data = frame(3000, 7)
    _, links = exact_links(data)
    table, _ = encode_table(SCHEMA, data)
    dim = links.dim  # type: ignore[attr-defined]
    clip = math.sqrt(dim)
    unit, _ = clip_to_unit_ball(links.to_latent(table, np.random.default_rng(0)), clip)  # type: ignore[attr-defined]
    est = dppca.combine([exact_factor(unit.T @ unit / table.n_rows)], dim)
    synth = fm.FactorModelSynthesizer(SCHEMA, epsilon=1.0, subspace=est, links=links,
                                      rng=np.random.default_rng(11)).fit(data)
    # The same steps by hand, with the same random stream (the synthesizer first draws the
    # latent rows of its table, then the correction's simulation, then the calibration).
    rng = np.random.default_rng(11)
    links.to_latent(table, rng)  # type: ignore[attr-defined]
    model, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng,  # type: ignore[arg-type]
                                   n_simulations=synth.n_simulations, n_rows=table.n_rows)
    decode, _ = calibrated_links(links, model, rng,  # type: ignore[arg-type]
                                 n_rows=table.n_rows)
    assert corr is not None and synth.latent_correlation_ is not None
    np.testing.assert_allclose(synth.latent_correlation_, corr)
    np.testing.assert_allclose(synth.model_.multiplier, model.multiplier)
    for mine, theirs in zip(synth.decode_links_.links, decode.links, strict=True):
        np.testing.assert_allclose(getattr(mine, "proportions", 0.0),
                                   getattr(theirs, "proportions", 0.0))
    assert synth.privacy_costs_ == {}


def test_central_synthesizer_spends_like_the_link_round() -> None:
    synth = fm.FactorModelSynthesizer(SCHEMA, epsilon=2.0, delta=1e-6, n_bins=BINS,
                                      rng=np.random.default_rng(1)).fit(frame(800, 1))
    marg = synth.privacy_costs_["marginals"]
    assert marg.mechanism == "gaussian"
    assert marg.sensitivity == pytest.approx(link_histogram_sensitivity(SCHEMA))
    assert marg.sensitivity == pytest.approx(math.sqrt(2 * len(SCHEMA.columns)))
    assert sum(synth.delta_budget_.values()) == pytest.approx(1e-6)
    assert set(synth.delta_budget_) == {"marginals", "pca", "pair_scores", "pairs"}
    assert synth.privacy_cost_.epsilon == pytest.approx(2.0)
    assert synth.privacy_cost_.delta == pytest.approx(1e-6)
    assert synth.proportions_ is not None
    # Synthetic marginals reproduce the released DP marginals (up to sampling error).
    out = synth.sample_encoded(100_000)
    blocks = split_proportions(synth.proportions_, SCHEMA, BINS, synth.resolution)
    for name, size in (("ward", 3), ("sex", 2)):
        got = np.bincount(out.columns[name], minlength=size) / out.n_rows
        assert 0.5 * float(np.abs(got - blocks[name]).sum()) < 0.01, name


def test_aligned_latent_validates_the_factor_width() -> None:
    synth = fm.FactorModelSynthesizer(SCHEMA, epsilon=1.0, mode="row_aligned",
                                      rng=np.random.default_rng(2)).fit(frame(400, 2))
    with pytest.raises(ValidationError, match="columns"):
        aligned_latent(np.zeros((3, synth.rank_ + 1)), synth.model_)
