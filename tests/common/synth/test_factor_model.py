"""Factor-model synthesizer (seed 000, Alg. 1 with the corrections in docs/algorithms.md).

Layers: validation; cost and budget arithmetic (no randomness); the rank rule on examples;
the non-private limit (noise disabled / epsilon huge) reproduces X V V^T; seeded statistical
tests of the factor noise calibration with a half-noise copy and the seed's one-column copy
that must be caught; typed output for both modes.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pandas as pd
import pytest

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.pca.dppca import PCAEstimate, top_components
from dpfed.common.privacy.mechanisms import LaplaceMechanism
from dpfed.common.synth import factor_model as fm
from dpfed.common.synth import links as lk
from dpfed.common.synth.correlation import (
    MIN_ROWS_FOR_DATA,
    fast_latent_correlation,
    simulation_rows,
)


def make_schema() -> Schema:
    return Schema.from_dict({"columns": [
        {"name": "age", "type": "continuous", "min": 0, "max": 100},
        {"name": "bmi", "type": "continuous", "min": 10, "max": 60},
        {"name": "sbp", "type": "continuous", "min": 60, "max": 220},
        {"name": "severity", "type": "ordinal", "levels": ["mild", "moderate", "severe"]},
        {"name": "stage", "type": "ordinal", "levels": ["1", "2", "3", "4"]},
        {"name": "ward", "type": "nominal", "categories": ["a", "b", "c", "d"]},
        {"name": "sex", "type": "nominal", "categories": ["f", "m"]},
    ]})


def make_frame(n: int, seed: int = 0) -> pd.DataFrame:
    """Mixed-type rows with a two-factor structure."""
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((n, 2))

    def lat(w: tuple[float, float], noise: float = 0.6) -> np.ndarray:
        return np.asarray(f @ np.array(w) + noise * rng.standard_normal(n))

    def cat(values: np.ndarray, labels: list[str], ordered: bool = False) -> pd.Categorical[str]:
        codes: npt.NDArray[np.int64] = np.asarray(values, dtype=np.int64)
        return pd.Categorical.from_codes(codes, categories=pd.Index(labels), ordered=ordered)

    return pd.DataFrame({
        "age": np.clip(50 + 12 * lat((1.0, 0.2)), 0, 100),
        "bmi": np.clip(27 + 4 * lat((0.8, -0.3)), 10, 60),
        "sbp": np.clip(130 + 15 * lat((0.2, 1.0)), 60, 220),
        "severity": cat(np.digitize(lat((0.9, 0.0)), [-0.3, 1.0]),
                        ["mild", "moderate", "severe"], ordered=True),
        "stage": cat(np.digitize(lat((0.0, 0.9)), [-1.0, 0.0, 1.0]), ["1", "2", "3", "4"],
                     ordered=True),
        "ward": cat(np.digitize(lat((0.7, 0.7)), [-1.2, 0.0, 0.9]), ["a", "b", "c", "d"]),
        "sex": cat(lat((0.3, -0.5)) > 0.2, ["f", "m"]),
    })


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", None])
def test_epsilon_is_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="epsilon"):
        fm.FactorModelSynthesizer(make_schema(), epsilon=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="epsilon"):
        fm.factor_cost(2, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, match", [
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"mode": "copy"}, "mode"),
    ({"rank": 0}, "rank"),
    ({"rank": 11}, "rank"),  # latent dimension is 3 + 2 + 3 + 1 = 9
    ({"rank": 2.0}, "rank"),
    ({"info_threshold": 0.0}, "info_threshold"),
    ({"info_threshold": 1.0}, "info_threshold"),
    ({"info_threshold": 1.5}, "info_threshold"),
    ({"budget_split": {"noise": 1.0}}, "budget_split"),
    ({"budget_split": {"pca": -1.0}}, "budget_split"),
    ({"continuous_scaling": "bounds"}, "continuous_scaling='dp'"),
    ({"clip_norm": -1.0}, "clip_norm"),
    ({"pca_calibration": "loose"}, "pca_calibration"),
    ({"subspace": np.eye(9)}, "PCAEstimate"),
    ({"subspace": PCAEstimate(np.eye(4), np.ones(4), 4.0)}, "K x 9"),
])
def test_constructor_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        fm.FactorModelSynthesizer(make_schema(), epsilon=1.0, **kwargs)  # type: ignore[arg-type]


def test_fit_and_sample_validation() -> None:
    synth = fm.FactorModelSynthesizer(make_schema(), epsilon=1.0,
                                      rng=np.random.default_rng(0))
    with pytest.raises(ValidationError, match="fit"):
        synth.sample()
    with pytest.raises(DataError, match="missing column"):
        synth.fit(make_frame(50).drop(columns=["ward"]))
    with pytest.raises(DataError, match="no rows"):
        synth.fit(make_frame(50).iloc[:0])
    with pytest.raises(ValidationError, match="needs"):
        fm.FactorModelSynthesizer(make_schema(), epsilon=1.0, mode="row_aligned",
                                  budget_split={"pca": 1.0, "marginals": 1.0}).fit(make_frame(50))
    aligned = fm.FactorModelSynthesizer(make_schema(), epsilon=1.0, mode="row_aligned",
                                        rng=np.random.default_rng(0)).fit(make_frame(200))
    with pytest.raises(ValidationError, match="one synthetic row per real row"):
        aligned.sample(10)
    with pytest.raises(ValidationError, match="n must be"):
        fm.FactorModelSynthesizer(make_schema(), epsilon=1.0,
                                  rng=np.random.default_rng(0)).fit(make_frame(200)).sample(-1)


def test_factor_release_validation() -> None:
    rng = np.random.default_rng(1)
    v = np.linalg.qr(rng.standard_normal((5, 2)))[0]
    x = rng.standard_normal((10, 5)) * 0.1
    with pytest.raises(ValidationError, match="unit L2 ball"):
        fm.factor_release(x * 100, v, epsilon=1.0, rng=rng)
    with pytest.raises(ValidationError, match="orthonormal"):
        fm.factor_release(x, v * 2, epsilon=1.0, rng=rng)
    with pytest.raises(ValidationError, match="loadings have 5 rows"):
        fm.factor_release(x[:, :4], v, epsilon=1.0, rng=rng)
    with pytest.raises(ValidationError, match="epsilon"):
        fm.factor_release(x, v, epsilon=0.0, rng=rng)
    with pytest.raises(ValidationError, match="1 <= r <= p"):
        fm.factor_release(x[:, :1], np.eye(2)[:1], epsilon=1.0, rng=rng)


def test_rank_rule_validation() -> None:
    for bad in (0.0, 1.0, -0.2, 2.0, math.nan):
        with pytest.raises(ValidationError, match="threshold"):
            fm.choose_rank(np.array([1.0, 0.5]), bad)
    with pytest.raises(ValidationError, match="empty"):
        fm.choose_rank(np.array([]), 0.8)
    with pytest.raises(ValidationError, match="max_rank"):
        fm.choose_rank(np.array([1.0]), 0.8, max_rank=0)


# --------------------------------------------------------------------------- rank rule


@pytest.mark.parametrize("c, expected", [(0.49, 1), (0.5, 2), (0.79, 2), (0.8, 3), (0.9, 4),
                                         (0.95, 4)])
def test_rank_rule_examples(c: float, expected: int) -> None:
    # Cumulative ratios 0.5, 0.8, 0.9, 1.0; the rule needs a ratio strictly above c.
    assert fm.choose_rank(np.array([5.0, 3.0, 1.0, 1.0]), c) == expected


def test_rank_rule_on_noisy_and_partial_spectra() -> None:
    assert fm.choose_rank(np.array([1.0, 3.0, 5.0, 1.0]), 0.79) == 2  # sorted first
    assert fm.choose_rank(np.array([5.0, 3.0, -0.5, 1.0, 1.0]), 0.8) == 3  # negatives -> 0
    # Only the top 2 of a spectrum with total 20 are known: no prefix exceeds c.
    assert fm.choose_rank(np.array([5.0, 3.0]), 0.8, total=20.0) == 2
    assert fm.choose_rank(np.array([5.0, 3.0, 1.0, 1.0]), 0.9, max_rank=2) == 2
    assert fm.choose_rank(np.zeros(3), 0.8) == 1


# --------------------------------------------------------------------------- cost arithmetic


def test_factor_cost_arithmetic() -> None:
    cost = fm.factor_cost(4, 0.5)
    assert cost.epsilon == 0.5 and cost.delta == 0.0
    assert cost.sensitivity == pytest.approx(4.0)  # 2 sqrt(4)
    assert cost.noise_scale == pytest.approx(8.0)  # 2 sqrt(r) / epsilon
    assert fm.factor_mechanism(9, 2.0).scale == pytest.approx(3.0)


def test_budget_split_defaults_and_total() -> None:
    frame = make_frame(300)
    gen = fm.FactorModelSynthesizer(make_schema(), epsilon=2.0, delta=1e-6,
                                    rng=np.random.default_rng(0)).fit(frame)
    # Default: the job's split with its two pair rounds (pairs = columns - 1).
    assert gen.pairs == len(make_schema().columns) - 1
    assert gen.budget_ == pytest.approx({"marginals": 1.2, "pca": 0.5, "pair_scores": 0.06,
                                         "pairs": 0.24})
    assert gen.delta_budget_ == pytest.approx({"marginals": 4e-7, "pca": 3e-7,
                                               "pair_scores": 1e-7, "pairs": 2e-7})
    assert gen.privacy_cost_.epsilon == pytest.approx(2.0)
    assert gen.privacy_cost_.delta == pytest.approx(1e-6)
    assert set(gen.privacy_costs_) == {"marginals", "pca", "pair_scores", "pairs"}
    plain = fm.FactorModelSynthesizer(make_schema(), epsilon=2.0, delta=1e-6, pairs=0,
                                      rng=np.random.default_rng(0)).fit(frame)
    assert plain.budget_ == pytest.approx({"marginals": 1.6, "pca": 0.4})  # the old split
    assert plain.delta_budget_ == pytest.approx({"marginals": 5e-7, "pca": 5e-7})
    assert set(plain.privacy_costs_) == {"marginals", "pca"}
    assert plain.pair_correction_ is None and plain.pair_edges_ == []
    before = gen.privacy_cost_
    gen.sample(100)
    gen.sample(100)
    assert gen.privacy_cost_ == before  # sampling is post-processing
    aligned = fm.FactorModelSynthesizer(make_schema(), epsilon=2.0, delta=1e-6,
                                        mode="row_aligned", rng=np.random.default_rng(0)
                                        ).fit(frame)
    assert aligned.budget_ == pytest.approx({"marginals": 0.4, "pca": 0.4, "factors": 1.2})
    assert aligned.privacy_cost_.epsilon == pytest.approx(2.0)
    factor = aligned.privacy_costs_["factors"]
    assert factor.noise_scale == pytest.approx(2 * math.sqrt(aligned.rank_) / 1.2)
    # Every release is calibrated to replace-one: the advertised total is the true one.
    assert aligned.privacy_cost_replace_one_ == aligned.privacy_cost_
    assert aligned.privacy_costs_["pca"].sensitivity == pytest.approx(
        math.sqrt(2) / aligned.n_rows_)


def test_budget_is_renormalised_over_needed_releases() -> None:
    schema = Schema.from_dict({"columns": [
        {"name": "x", "type": "continuous", "min": 0, "max": 1},
        {"name": "y", "type": "continuous", "min": 0, "max": 1}]})
    rng = np.random.default_rng(2)
    frame = pd.DataFrame({"x": rng.uniform(size=100), "y": rng.uniform(size=100)})
    synth = fm.FactorModelSynthesizer(schema, epsilon=1.0, mode="row_aligned",
                                      continuous_scaling="bounds", rng=rng).fit(frame)
    assert synth.budget_ == pytest.approx({"pca": 0.25, "factors": 0.75})
    subspace = PCAEstimate(np.eye(2), np.array([0.3, 0.2]), 0.5)
    with pytest.raises(ValidationError, match="subspace needs links="):
        fm.FactorModelSynthesizer(schema, epsilon=1.0, subspace=subspace, rank=1, rng=rng)
    links = lk.LatentLinks.from_proportions(schema, {}, {"x": (0.0, 0.58), "y": (0.0, 0.58)})
    given = fm.FactorModelSynthesizer(schema, epsilon=1.0, subspace=subspace, rank=1,
                                      links=links, rng=rng).fit(frame)
    assert given.budget_ == {}  # nothing is fitted centrally: no marginals, no PCA
    assert given.privacy_costs_ == {} and given.rank_ == 1 and given.links_ is links


def test_a_pca_job_result_is_refused_as_subspace() -> None:
    class FeatureSpaceResult(PCAEstimate):
        feature_names_in_ = ("a",)

    wrong = FeatureSpaceResult(np.eye(9), np.ones(9), 9.0)
    with pytest.raises(ValidationError, match="feature space"):
        fm.FactorModelSynthesizer(make_schema(), epsilon=1.0, subspace=wrong)


# --------------------------------------------------------------------------- non-private limit


def exact_setup(n: int, seed: int) -> tuple[lk.LatentLinks, EncodedTable, np.ndarray, float]:
    """Links with exact proportions, the latent unit-ball rows and a clip norm that never
    clips (so multiplying by it undoes the scaling exactly)."""
    from dpfed.common.data.encoding import encode_table
    schema = make_schema()
    table, _ = encode_table(schema, make_frame(n, seed))
    rng = np.random.default_rng(seed)
    proportions = {c.name: np.bincount(table.columns[c.name], minlength=m) / n
                   for c, m in ((schema.column("severity"), 3), (schema.column("stage"), 4),
                                (schema.column("ward"), 4), (schema.column("sex"), 2))}
    links = lk.LatentLinks.from_proportions(schema, proportions)
    latent = links.to_latent(table, rng)
    clip = float(np.sqrt(np.einsum("ij,ij->i", latent, latent)).max()) * 1.01
    unit, clipped = lk.clip_to_unit_ball(latent, clip)
    assert clipped == 0
    return links, table, unit, clip


def test_noiseless_factors_reproduce_x_v_vt() -> None:
    links, _, unit, clip = exact_setup(2000, 3)
    v = top_components(unit.T @ unit, 4).T  # p x r, exact (non-private) eigenvectors
    w = fm._project(unit, v)  # the test-only noiseless path of factor_release
    np.testing.assert_allclose(w @ v.T, unit @ v @ v.T, atol=1e-12)
    # epsilon -> huge: the DP release converges to the same reconstruction.
    w_dp, cost = fm.factor_release(unit, v, epsilon=1e12, rng=np.random.default_rng(0))
    np.testing.assert_allclose(w_dp @ v.T, unit @ v @ v.T, atol=1e-9)
    assert cost.noise_scale == pytest.approx(4.0 / 1e12)
    # Decoding X V V^T equals decoding it directly through the links.
    decoded = fm.reconstruct_rows(w, v, links, clip_norm=clip)
    direct = links.from_latent(unit @ v @ v.T * clip)
    for name in links.schema.names:
        np.testing.assert_allclose(decoded.columns[name], direct.columns[name], atol=1e-9)


def test_full_rank_noiseless_reconstruction_is_the_data() -> None:
    links, table, unit, clip = exact_setup(2000, 4)
    v = top_components(unit.T @ unit, links.dim).T
    decoded = fm.reconstruct_rows(fm._project(unit, v), v, links, clip_norm=clip)
    for name in ("severity", "stage", "ward", "sex"):
        np.testing.assert_array_equal(decoded.columns[name], table.columns[name])
    for name in ("age", "bmi", "sbp"):
        np.testing.assert_allclose(decoded.columns[name], table.columns[name], atol=1e-9)


def test_synthesizer_with_huge_epsilon_tracks_the_data() -> None:
    frame = make_frame(5000, 5)
    synth = fm.FactorModelSynthesizer(make_schema(), epsilon=1e6, mode="row_aligned",
                                      rank=9, rescale_latent=False,
                                      rng=np.random.default_rng(5)).fit(frame)
    out = synth.sample()
    # Full rank, no noise to speak of: only rows shrunk by the clip change.
    unclipped_share = 1 - synth.n_clipped_ / len(frame)
    for name in ("severity", "stage", "ward", "sex"):
        agree = float(np.mean(out[name].astype(str).to_numpy() == frame[name].astype(str)))
        assert agree >= unclipped_share
    assert out["age"].corr(frame["age"]) > 0.95


# --------------------------------------------------------------------------- factor noise


def factor_noise(mechanism: object | None, rank: int, epsilon: float,
                 reps: int) -> np.ndarray:
    rng = np.random.default_rng(6)
    p = 8
    v = np.linalg.qr(rng.standard_normal((p, rank)))[0]
    x, _ = lk.clip_to_unit_ball(rng.standard_normal((400, p)), 3.0)
    exact = x @ v
    original = fm.factor_mechanism
    if mechanism is not None:
        fm.factor_mechanism = mechanism  # type: ignore[assignment]
    try:
        return np.stack([fm.factor_release(x, v, epsilon=epsilon, rng=rng)[0] - exact
                         for _ in range(reps)])
    finally:
        fm.factor_mechanism = original


def half_noise(rank: int, epsilon: float) -> LaplaceMechanism:
    """Planted bug: half the sensitivity."""
    return LaplaceMechanism(epsilon, math.sqrt(rank))


class SeedColumnNoise:
    """Planted bug: the seed's literal Alg. 1 step 3(I) -- Lap(2/epsilon) on column r only."""

    def __init__(self, rank: int, epsilon: float) -> None:
        self.inner = LaplaceMechanism(epsilon, 2.0)

    def cost(self) -> object:
        return self.inner.cost()

    def release(self, value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = np.array(value, dtype=np.float64)
        out[:, -1] = self.inner.release(out[:, -1], rng)
        return out


@pytest.mark.parametrize("mechanism, ok", [(None, True), (half_noise, False),
                                           (SeedColumnNoise, False)])
def test_factor_noise_has_scale_2_sqrt_r_over_epsilon_in_every_entry(
        mechanism: object | None, ok: bool) -> None:
    rank, epsilon = 4, 0.8
    noise = factor_noise(mechanism, rank, epsilon, reps=5)  # 5 x 400 x 4 entries
    expected = 2 * math.sqrt(rank) / epsilon
    per_column = np.mean(np.abs(noise), axis=(0, 1)) / expected  # Laplace: E|X| = b
    # Each column mean |X| over 2000 draws has relative standard error 1/sqrt(2000) = 2.2%.
    if ok:
        assert np.all(np.abs(per_column - 1.0) < 0.1), per_column
        # Laplace shape: Var = 2 b^2.
        assert float(np.var(noise)) == pytest.approx(2 * expected ** 2, rel=0.1)
    else:
        assert np.any(per_column < 0.75), per_column


# --------------------------------------------------------------------------- generative


def test_generative_latent_has_the_model_covariance() -> None:
    schema = Schema.from_dict({"columns": [
        {"name": f"x{j}", "type": "continuous", "min": -1000, "max": 1000} for j in range(4)]})
    # mean 0, sd 1/1000 of v = y/1000: the latent coordinate is y itself.
    links = lk.LatentLinks.from_proportions(schema, {}, {f"x{j}": (0.0, 1e-3)
                                                         for j in range(4)})
    rng = np.random.default_rng(7)
    v = fm.orthonormalize(rng.standard_normal((4, 2)))
    lam = np.array([0.5, 0.2])
    out = fm.sample_generative(100_000, v, lam, links, clip_norm=2.0, rng=rng, residual=0.05,
                               rescale=False)
    y = np.column_stack([out.columns[f"x{j}"] for j in range(4)])
    model = 4.0 * (v @ np.diag(lam) @ v.T + 0.05 * (np.eye(4) - v @ v.T))
    np.testing.assert_allclose(np.cov(y.T), model, atol=0.03)
    np.testing.assert_allclose(y.mean(axis=0), 0.0, atol=0.02)


def test_latent_rescaling_targets_unit_variance() -> None:
    schema = Schema.from_dict({"columns": [
        {"name": "s", "type": "ordinal", "levels": ["a", "b", "c"]},
        {"name": "x", "type": "continuous", "min": 0, "max": 1}]})
    links = lk.LatentLinks.from_proportions(schema, {"s": [0.2, 0.3, 0.5]})  # x: bounds only
    v = np.eye(2)[:, :1]
    scale = fm.latent_rescaling(links, v, np.array([0.09]), clip_norm=2.0, residual=0.01)
    # coordinate 0 modelled 0.09 -> target 1/4; coordinate 1 modelled = target = 0.01.
    np.testing.assert_allclose(scale, [math.sqrt(0.25 / 0.09), 1.0])
    noisy = fm.latent_rescaling(links, v, np.array([0.09]), clip_norm=2.0, residual=0.01,
                                factor_noise_variance=0.16, include_residual=False)
    np.testing.assert_allclose(noisy, [math.sqrt(0.25 / 0.25), 1.0])


def test_generative_sampling_recovers_marginals_at_large_epsilon() -> None:
    frame = make_frame(20_000, 8)
    synth = fm.FactorModelSynthesizer(make_schema(), epsilon=50.0,
                                      rng=np.random.default_rng(8)).fit(frame)
    out = synth.sample(20_000)
    for name in ("severity", "stage", "ward", "sex"):
        real = frame[name].value_counts(normalize=True).sort_index()
        fake = out[name].value_counts(normalize=True).sort_index()
        assert 0.5 * float(np.abs(real - fake).sum()) < 0.03, name
    assert out["age"].mean() == pytest.approx(frame["age"].mean(), abs=1.0)
    assert out["age"].corr(out["bmi"]) == pytest.approx(frame["age"].corr(frame["bmi"]),
                                                        abs=0.12)


def test_perturbed_loadings_are_orthonormal_and_post_processing() -> None:
    rng = np.random.default_rng(9)
    v = fm.orthonormalize(rng.standard_normal((6, 3)))
    np.testing.assert_allclose(fm.orthonormalize(v), v, atol=1e-12)  # sign convention
    close = fm.perturb_loadings(v, epsilon=1e9, rng=rng)
    np.testing.assert_allclose(close, v, atol=1e-6)
    far = fm.perturb_loadings(v, epsilon=0.1, rng=rng, eigenvalues=np.array([3.0, 2.0, 1.0]))
    np.testing.assert_allclose(far.T @ far, np.eye(3), atol=1e-10)
    synth = fm.FactorModelSynthesizer(make_schema(), epsilon=1.0, loading_noise_epsilon=5.0,
                                      rng=rng).fit(make_frame(500))
    assert synth.privacy_cost_.epsilon == pytest.approx(1.0)  # costs nothing extra


# --------------------------------------------------------------------------- typed output


@pytest.mark.parametrize("mode", ["generative", "row_aligned"])
def test_output_has_the_schema_types(mode: str) -> None:
    schema = make_schema()
    frame = make_frame(1500, 10)
    synth = fm.FactorModelSynthesizer(schema, epsilon=1.0, mode=mode,
                                      rng=np.random.default_rng(10)).fit(frame)
    out = synth.sample()
    assert list(out.columns) == list(schema.names)
    assert len(out) == 1500
    for col in schema.columns:
        series = out[col.name]
        if col.type == "continuous":
            assert series.dtype == np.float64
            assert series.min() >= col.min and series.max() <= col.max
        else:
            assert isinstance(series.dtype, pd.CategoricalDtype)
            labels = col.levels if col.type == "ordinal" else col.categories
            assert list(series.cat.categories) == list(labels)
            assert series.cat.ordered == (col.type == "ordinal")
            assert not series.isna().any()
    assert 1 <= synth.rank_ <= synth.links_.dim
    assert synth.components_.shape == (synth.rank_, synth.links_.dim)
    if mode == "generative":
        assert len(synth.sample(123)) == 123
        assert len(synth.sample(0)) == 0
        assert not synth.sample(50).equals(synth.sample(50))
    else:
        assert synth.sample().equals(out)  # no fresh randomness after fit


# --------------------------------------------------------------------------- correlation fix


def test_dp_second_moment_rebuilds_the_matrix() -> None:
    rng = np.random.default_rng(11)
    v = fm.orthonormalize(rng.standard_normal((5, 5)))
    lam = np.array([0.4, 0.2, 0.1, 0.05, 0.0])
    full = fm.dp_second_moment(PCAEstimate(v.T, lam, float(lam.sum())), 5)
    np.testing.assert_allclose(full, v @ np.diag(lam) @ v.T, atol=1e-12)
    top = fm.dp_second_moment(PCAEstimate(v[:, :2].T, lam[:2], 0.9), 5)
    assert np.trace(top) == pytest.approx(0.9)
    np.testing.assert_allclose(top @ v[:, 0], 0.4 * v[:, 0], atol=1e-12)
    with pytest.raises(ValidationError, match="expected 4"):
        fm.dp_second_moment(PCAEstimate(v.T, lam, 1.0), 4)


def correlated_setup(n: int, seed: int) -> tuple[lk.LatentLinks, np.ndarray, np.ndarray]:
    """Data drawn from the link model with a known latent correlation R."""
    schema = Schema.from_dict({"columns": [
        {"name": "x", "type": "continuous", "min": -50, "max": 50},
        {"name": "b1", "type": "ordinal", "levels": ["0", "1"]},
        {"name": "b2", "type": "ordinal", "levels": ["0", "1"]},
        {"name": "g", "type": "nominal", "categories": ["a", "b", "c"]},
    ]})
    links = lk.LatentLinks.from_proportions(
        schema, {"b1": [0.5, 0.5], "b2": [0.3, 0.7], "g": [0.3, 0.3, 0.4]},
        {"x": (0.0, 0.02)})
    r = np.array([[1.0, 0.6, 0.5, 0.3, 0.0],
                  [0.6, 1.0, 0.7, 0.0, 0.3],
                  [0.5, 0.7, 1.0, 0.2, 0.2],
                  [0.3, 0.0, 0.2, 1.0, 0.0],
                  [0.0, 0.3, 0.2, 0.0, 1.0]])
    rng = np.random.default_rng(seed)
    z = rng.multivariate_normal(np.zeros(5), r, size=n)
    unit, _ = lk.clip_to_unit_ball(links.to_latent(links.from_latent(z), rng), 3.0)
    return links, r, unit.T @ unit / n


def test_latent_correlation_undoes_the_attenuation() -> None:
    links, r, moment = correlated_setup(40_000, 12)
    attenuated = moment / np.sqrt(np.outer(np.diag(moment), np.diag(moment)))
    # The independent draws attenuate the binary-binary correlation by about 2/pi.
    assert attenuated[1, 2] < r[1, 2] - 0.15
    fixed = fm.latent_correlation(moment, links, clip_norm=3.0, rng=np.random.default_rng(13),
                                  n_simulations=40_000)
    np.testing.assert_allclose(np.diag(fixed), 1.0, atol=1e-12)
    assert np.all(np.linalg.eigvalsh(fixed) > 0)
    assert fixed[3, 4] == pytest.approx(0.0, abs=1e-6)  # one nominal column: uncorrelated
    # Monte-Carlo error of a simulated correlation is ~0.005 (40k rows, twice); inverting the
    # attenuation divides it by the slope: ~0.6 between continuous/binary coordinates, ~0.25
    # for a binary against a nominal coordinate. Tolerances follow.
    tolerance = np.full((5, 5), 0.04)
    tolerance[1:3, 3:] = tolerance[3:, 1:3] = 0.08
    assert np.all(np.abs(fixed - r) <= tolerance), np.round(fixed - r, 3)


def test_simulation_rows_follow_the_data_and_the_dimension() -> None:
    assert simulation_rows(10) == 50_000 and simulation_rows(400) == 20_000
    assert simulation_rows(10, 6_300) == 12_600
    assert simulation_rows(10, 1_000) == MIN_ROWS_FOR_DATA
    assert simulation_rows(10, 10**7) == 50_000 and simulation_rows(400, 10**7) == 20_000


def test_the_data_sized_simulation_error_is_below_the_datas_own_sampling_error() -> None:
    """With ``n_rows`` the correction simulates 2 N rows (here 10 000 for N = 5 000): its
    Monte-Carlo error (against a 50 000-row simulation) stays below the sampling error the
    corrected correlation carries from the N rows (against the true correlation)."""
    monte_carlo, sampling = [], []
    for seed in range(4):
        links, r, moment = correlated_setup(5_000, 20 + seed)
        sized = fast_latent_correlation(moment, links, clip_norm=3.0, n_rows=5_000,
                                        rng=np.random.default_rng(seed))
        large = fast_latent_correlation(moment, links, clip_norm=3.0,
                                        rng=np.random.default_rng(100 + seed))
        free = ~np.eye(5, dtype=bool)
        free[3:, 3:] = False  # the nominal block's zeros are pinned
        monte_carlo.append(float(np.sqrt(np.mean((sized - large)[free] ** 2))))
        sampling.append(float(np.sqrt(np.mean((large - r)[free] ** 2))))
    assert np.mean(monte_carlo) < np.mean(sampling), (monte_carlo, sampling)


def test_latent_correlation_validation() -> None:
    links, _, moment = correlated_setup(500, 14)
    with pytest.raises(ValidationError, match="5 x 5"):
        fm.latent_correlation(moment[:4, :4], links, clip_norm=3.0,
                              rng=np.random.default_rng(0))
    bounds = lk.LatentLinks.from_proportions(links.schema, {"b1": [0.5, 0.5], "b2": [0.3, 0.7],
                                                           "g": [0.3, 0.3, 0.4]})
    with pytest.raises(ValidationError, match="standard normal"):
        fm.latent_correlation(moment, bounds, clip_norm=3.0, rng=np.random.default_rng(0))
    with pytest.raises(ValidationError, match="n_simulations"):
        fm.latent_correlation(moment, links, clip_norm=3.0, rng=np.random.default_rng(0),
                              n_simulations=10)


def numeric_view(frame: pd.DataFrame) -> np.ndarray:
    cols = [frame[c].to_numpy(dtype=float) for c in ("age", "bmi", "sbp")]
    cols += [frame[c].cat.codes.to_numpy(dtype=float) for c in ("severity", "stage", "sex")]
    return np.column_stack(cols)


def test_generative_mode_keeps_categorical_correlations() -> None:
    frame = make_frame(20_000, 15)
    real = np.corrcoef(numeric_view(frame).T)
    involves_categorical = np.zeros((6, 6), dtype=bool)
    involves_categorical[3:, :] = involves_categorical[:, 3:] = True
    np.fill_diagonal(involves_categorical, False)
    errors = {}
    for correct in (True, False):
        # pairs=0: the correlation correction alone (the pair correction moves rows).
        synth = fm.FactorModelSynthesizer(make_schema(), epsilon=1e4, rank=9,
                                          correct_correlation=correct, pairs=0,
                                          rng=np.random.default_rng(15)).fit(frame)
        assert (synth.latent_correlation_ is not None) == correct
        fake = np.corrcoef(numeric_view(synth.sample(20_000)).T)
        errors[correct] = float(np.abs(real - fake)[involves_categorical].mean())
    # Without the correction the categorical correlations are attenuated twice.
    assert errors[True] < 0.03
    assert errors[False] > 2 * errors[True]
