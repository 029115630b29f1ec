"""Mixed-type links (seed 000, Alg. 2) and the DP marginals they are fitted from.

Layers: validation; cost arithmetic (no randomness); exact round trips; seeded statistical
tests of the samplers against the exact conditional distributions (KS), each also run on a
deliberately broken sampler that the same test must reject; noise calibration of the DP
marginals, with a half-noise copy that must be caught.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import integrate, special, stats
from scipy.interpolate import CubicSpline

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.exact_samplers import DiscreteLaplaceMechanism
from dpfed.common.synth import dp_marginals as dm
from dpfed.common.synth import links as lk

ALPHA = 1e-3  # a correct sampler must pass at this level ...
POWER = 1e-6  # ... and a broken one must fail at this level


def make_schema() -> Schema:
    return Schema.from_dict({"columns": [
        {"name": "age", "type": "continuous", "min": 0, "max": 100},
        {"name": "bmi", "type": "continuous", "min": 10, "max": 60},
        {"name": "severity", "type": "ordinal", "levels": ["mild", "moderate", "severe", "icu"]},
        {"name": "ward", "type": "nominal", "categories": ["a", "b", "c", "d"]},
        {"name": "sex", "type": "nominal", "categories": ["f", "m"]},
    ]})


SEVERITY = np.array([0.5, 0.3, 0.15, 0.05])
WARD = np.array([0.1, 0.5, 0.3, 0.1])
SEX = np.array([0.45, 0.55])


def make_table(n: int, rng: np.random.Generator) -> EncodedTable:
    schema = make_schema()
    cols: dict[str, np.ndarray] = {
        "age": rng.uniform(0, 100, n),
        "bmi": np.clip(rng.normal(27, 5, n), 10, 60),
        "severity": rng.choice(4, size=n, p=SEVERITY).astype(np.int32),
        "ward": rng.choice(4, size=n, p=WARD).astype(np.int32),
        "sex": rng.choice(2, size=n, p=SEX).astype(np.int32),
    }
    return EncodedTable(schema, cols, n)


def exact_links(schema: Schema | None = None) -> lk.LatentLinks:
    schema = schema or make_schema()
    return lk.LatentLinks.from_proportions(
        schema, {"severity": SEVERITY, "ward": WARD, "sex": SEX},
        {"age": (0.0, 0.58), "bmi": (-0.32, 0.2)})


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", None, True])
def test_release_marginals_validates_epsilon(bad: object) -> None:
    table = make_table(50, np.random.default_rng(0))
    with pytest.raises(ValidationError, match="epsilon"):
        dm.release_marginals(table, epsilon=bad, rng=np.random.default_rng(0))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="epsilon"):
        lk.fit_link_statistics(table, epsilon=bad,  # type: ignore[arg-type]
                               rng=np.random.default_rng(0))
    with pytest.raises(ValidationError, match="epsilon"):
        dm.dp_histogram(np.array([0, 1]), 2, epsilon=bad,  # type: ignore[arg-type]
                        rng=np.random.default_rng(0))


def test_continuous_scaling_is_validated() -> None:
    table = make_table(10, np.random.default_rng(0))
    with pytest.raises(ValidationError, match="continuous_scaling"):
        lk.fit_link_statistics(table, epsilon=1.0, rng=np.random.default_rng(0),
                               continuous_scaling="minmax")


def test_nothing_to_release_is_an_error() -> None:
    schema = Schema.from_dict({"columns": [
        {"name": "x", "type": "continuous", "min": 0, "max": 1}]})
    assert not lk.needs_link_statistics(schema, "bounds")
    assert lk.needs_link_statistics(schema, "dp")
    with pytest.raises(ValidationError, match="no marginal statistics"):
        dm.marginals_cost(schema, 1.0, moments=False)
    links = lk.combine_link_statistics(schema, None, continuous_scaling="bounds")
    assert links.dim == 1
    with pytest.raises(ValidationError, match="need DP statistics"):
        lk.combine_link_statistics(make_schema(), None)


def test_proportions_post_processing_gives_a_valid_distribution() -> None:
    p = dm.proportions_from_counts(np.array([-3.0, 0.0, 10.0, 30.0]), min_proportion=0.01)
    assert p.sum() == pytest.approx(1.0)
    assert p.min() == pytest.approx(0.01)
    # Negative counts -> 0, normalise to [0, 0, .25, .75], then mix with uniform (a = 0.04).
    np.testing.assert_allclose(p, [0.01, 0.01, 0.25, 0.73])
    uniform = dm.proportions_from_counts(np.array([-1.0, -5.0, -2.0]))
    np.testing.assert_allclose(uniform, 1 / 3)
    exact = dm.proportions_from_counts(np.array([1.0, 3.0]), min_proportion=0.0)
    np.testing.assert_allclose(exact, [0.25, 0.75])
    with pytest.raises(ValidationError, match="min_proportion"):
        dm.proportions_from_counts(np.array([1.0, 1.0]), min_proportion=0.5)
    with pytest.raises(ValidationError, match="counts"):
        dm.proportions_from_counts(np.array([1.0, math.nan]))
    with pytest.raises(ValidationError, match="counts"):
        dm.proportions_from_counts(np.array([1.0]))


def test_mean_variance_post_processing_clips() -> None:
    mean, var = dm.mean_variance_from_moments(np.array([50.0, 40.0]), 100)
    assert mean == pytest.approx(0.5) and var == pytest.approx(0.15)
    mean, var = dm.mean_variance_from_moments(np.array([500.0, -3.0]), 100, min_variance=1e-3)
    assert mean == 1.0 and var == 1e-3
    # Noise-aware floor: never below 2 b / N.
    mean, var = dm.mean_variance_from_moments(np.array([0.0, 0.5]), 100, noise_scale=5.0)
    assert var == pytest.approx(0.1)
    with pytest.raises(ValidationError, match="n_rows"):
        dm.mean_variance_from_moments(np.array([1.0, 1.0]), 0)


def test_link_parameters_are_validated() -> None:
    schema = make_schema()
    with pytest.raises(ValidationError, match="proportions"):
        lk.LatentLinks.from_proportions(schema, {"severity": [0.5, 0.5, 0.0, 0.0],
                                                 "ward": WARD, "sex": SEX})
    with pytest.raises(ValidationError, match="4 levels"):
        lk.LatentLinks.from_proportions(schema, {"severity": [0.5, 0.5],
                                                 "ward": WARD, "sex": SEX})
    with pytest.raises(ValidationError, match="no proportions"):
        lk.LatentLinks.from_proportions(schema, {"severity": SEVERITY, "sex": SEX})
    links = exact_links()
    with pytest.raises(ValidationError, match="shape"):
        links.from_latent(np.zeros((3, links.dim + 1)))
    with pytest.raises(ValidationError, match="finite"):
        links.from_latent(np.full((1, links.dim), np.nan))
    with pytest.raises(ValidationError, match="clip_norm"):
        lk.clip_to_unit_ball(np.zeros((2, 2)), 0.0)


def test_sum_releases_checks_shapes() -> None:
    rng = np.random.default_rng(0)
    a, _ = dm.release_marginals(make_table(20, rng), epsilon=1.0, rng=rng)
    b = dm.MarginalRelease({"severity": np.zeros(3)}, {}, 5, 1.0)
    with pytest.raises(ValidationError, match="different columns"):
        dm.sum_releases([a, b])
    with pytest.raises(ValidationError, match="at least one"):
        dm.sum_releases([])


# --------------------------------------------------------------------------- cost arithmetic


def test_marginal_sensitivity_and_cost_arithmetic() -> None:
    schema = make_schema()  # 2 continuous, 3 categorical
    # Replace-one: 2 per histogram, 9/4 per continuous (sum v, sum v^2) pair.
    assert dm.marginals_sensitivity(schema) == 2 * 3 + 2.25 * 2
    assert dm.marginals_sensitivity(schema, moments=False) == 2 * 3
    eps_h, eps_m = dm.split_marginals_epsilon(schema, 1.4)
    assert eps_h == pytest.approx(0.8) and eps_m == pytest.approx(0.6)
    # Both parts get the scale Delta_1 / epsilon of the whole vector.
    assert float(dm.histogram_mechanism(schema, eps_h).scale) == pytest.approx(10.5 / 1.4)
    assert dm.moments_mechanism(schema, eps_m).scale == pytest.approx(10.5 / 1.4)
    cost = lk.link_statistics_cost(schema, 1.4)
    assert cost.epsilon == pytest.approx(1.4) and cost.delta == 0.0
    bounds_only = lk.link_statistics_cost(schema, 0.5, "bounds")
    assert bounds_only.epsilon == 0.5 and bounds_only.mechanism == "discrete-laplace"
    assert bounds_only.noise_scale == pytest.approx(6 / 0.5)


def test_release_reports_its_cost_and_scale() -> None:
    rng = np.random.default_rng(3)
    table = make_table(100, rng)
    release, cost = lk.fit_link_statistics(table, epsilon=0.7, rng=rng)
    assert cost.epsilon == pytest.approx(0.7)
    assert release.noise_scale == pytest.approx(10.5 / 0.7)
    assert set(release.counts) == {"severity", "ward", "sex"}
    assert set(release.moments) == {"age", "bmi"}
    for v in release.counts.values():
        np.testing.assert_array_equal(v, np.round(v))  # exact discrete noise: integers
    release_b, _ = lk.fit_link_statistics(table, epsilon=0.7, rng=rng,
                                          continuous_scaling="bounds")
    assert release_b.moments == {}


# --------------------------------------------------------------------------- link maths


def test_ordinal_thresholds_examples() -> None:
    np.testing.assert_allclose(lk.ordinal_thresholds(np.array([0.5, 0.5])), [0.0], atol=1e-15)
    np.testing.assert_allclose(lk.ordinal_thresholds(np.array([0.25, 0.5, 0.25])),
                               [special.ndtri(0.25), special.ndtri(0.75)])


@pytest.mark.parametrize("pi", [
    [0.3, 0.7],
    [0.25, 0.375, 0.375],  # the seed's zero-mean model for Q = 3
    [0.9, 0.05, 0.05],
    [1e-4, 0.5, 0.4999],
    [0.1, 0.5, 0.3, 0.1],
    [0.3, 0.6, 1e-4, 0.1 - 1e-4],
    list(np.full(12, 1 / 12)),
])
def test_nominal_locations_reproduce_the_proportions(pi: list[float]) -> None:
    p = np.asarray(pi)
    m = lk.nominal_locations(p)
    np.testing.assert_allclose(lk.nominal_probabilities(m), p, rtol=1e-8, atol=1e-12)


def test_nominal_locations_converge_on_extreme_valid_proportions() -> None:
    # Search: DP proportions as the links see them -- one category near 1, others at the
    # floor -- for 3 to 12 categories (a case that once stalled the line search).
    rng = np.random.default_rng(11)
    cases = [np.array([0.00930119642237009, 0.9720954107332482, 9.999996415473108e-07,
                       0.01860239284474018])]
    for _ in range(150):
        q = int(rng.integers(3, 13))
        raw = rng.dirichlet(np.full(q, float(rng.choice([0.05, 0.3, 1.0]))))
        floor = float(rng.choice([1e-7, 1e-6, 1e-4]))
        p = np.maximum(raw, floor)
        cases.append(p / p.sum())
    for p in cases:
        m = lk.nominal_locations(p)
        np.testing.assert_allclose(lk.nominal_probabilities(m), p, rtol=1e-6, atol=1e-12)


def test_nominal_zero_locations_are_the_seed_model() -> None:
    # m = 0 gives 2^-(Q-1) for category 0 and equal shares for the rest.
    q = 4
    probs = lk.nominal_probabilities(np.zeros(q - 1))
    np.testing.assert_allclose(probs, [1 / 8, 7 / 24, 7 / 24, 7 / 24], atol=1e-10)
    np.testing.assert_allclose(lk.nominal_locations(probs), 0.0, atol=1e-8)
    assert lk.nominal_locations(np.array([0.2, 0.8]))[0] == pytest.approx(special.ndtri(0.8))


def test_round_trip_is_exact_for_codes() -> None:
    rng = np.random.default_rng(5)
    table = make_table(20_000, rng)
    links = exact_links()
    latent = links.to_latent(table, rng)
    assert latent.shape == (20_000, links.dim) and latent.flags.c_contiguous
    assert links.dim == 1 + 1 + 1 + 3 + 1
    assert links.latent_names == ("age", "bmi", "severity", "ward#1", "ward#2", "ward#3", "sex")
    back = links.from_latent(latent)
    for name in ("severity", "ward", "sex"):
        np.testing.assert_array_equal(back.columns[name], table.columns[name])
        assert back.columns[name].dtype == np.int32
    for name in ("age", "bmi"):
        np.testing.assert_allclose(back.columns[name], table.columns[name], rtol=0, atol=1e-9)


def test_round_trip_with_thresholds_from_other_proportions() -> None:
    # Any valid proportions give exact round trips (the thresholds only move the intervals).
    rng = np.random.default_rng(6)
    table = make_table(5_000, rng)
    links = lk.LatentLinks.from_proportions(
        make_schema(), {"severity": [0.01, 0.01, 0.01, 0.97], "ward": [0.97, 0.01, 0.01, 0.01],
                        "sex": [1e-4, 1 - 1e-4]})
    back = links.from_latent(links.to_latent(table, rng))
    for name in ("severity", "ward", "sex"):
        np.testing.assert_array_equal(back.columns[name], table.columns[name])


def test_continuous_inverse_clips_to_schema_bounds() -> None:
    links = exact_links()
    z = np.zeros((3, links.dim))
    z[:, 0] = [-100.0, 0.0, 100.0]
    out = links.from_latent(z).columns["age"]
    assert out[0] == 0.0 and out[2] == 100.0 and out[1] == pytest.approx(50.0)


def test_latent_of_data_with_the_model_proportions_is_standard_normal() -> None:
    # The mixture of the exact conditionals is N(m, I): every categorical coordinate of
    # e = u - m is N(0, 1), and the coordinates of one nominal column are uncorrelated.
    rng = np.random.default_rng(7)
    table = make_table(20_000, rng)
    links = exact_links()
    latent = links.to_latent(table, rng)
    for j in range(2, links.dim):
        assert stats.kstest(latent[:, j], "norm").pvalue > ALPHA, links.latent_names[j]
    corr = np.corrcoef(latent[:, 3:6].T)
    assert np.abs(corr - np.eye(3)).max() < 0.04


def test_sampling_the_latent_model_recovers_the_proportions() -> None:
    rng = np.random.default_rng(8)
    links = exact_links()
    n = 50_000
    decoded = links.from_latent(rng.standard_normal((n, links.dim)))
    for name, p in (("severity", SEVERITY), ("ward", WARD), ("sex", SEX)):
        counts = np.bincount(decoded.columns[name], minlength=p.size)
        assert stats.chisquare(counts, n * p).pvalue > ALPHA, name
    # The seed's zero-mean nominal model does not reproduce them (and the test notices).
    seed_model = lk.nominal_probabilities(np.zeros(3))
    counts = np.bincount(
        lk.NominalLink(make_schema().column("ward"), seed_model)  # type: ignore[arg-type]
        .inverse(rng.standard_normal((n, 3))), minlength=4)
    assert stats.chisquare(counts, n * WARD).pvalue < POWER


# --------------------------------------------------------------------------- samplers vs exact


def truncnorm_cdf(lower: float, upper: float) -> Callable[[np.ndarray], np.ndarray]:
    fa, fb = special.ndtr(lower), special.ndtr(upper)
    return lambda x: np.clip((special.ndtr(x) - fa) / (fb - fa), 0.0, 1.0)


def broken_interval_sampler(lower: np.ndarray, upper: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Planted bug: draw N(0,1) and clip into the interval instead of truncating."""
    return np.asarray(np.clip(special.ndtri(u), lower, np.nextafter(upper, -np.inf)))


@pytest.mark.parametrize("sampler, ok", [(lk.truncated_normal, True),
                                         (broken_interval_sampler, False)])
def test_truncated_normal_matches_exact_cdf(sampler: Callable[..., np.ndarray], ok: bool) -> None:
    rng = np.random.default_rng(9)
    n = 20_000
    pvalues = []
    for lower, upper in [(-np.inf, -0.5), (-0.5, 0.7), (0.7, 2.5), (2.5, np.inf),
                         (-6.0, -5.5)]:
        x = sampler(np.full(n, lower), np.full(n, upper), rng.uniform(size=n))
        assert np.all((x >= lower) & (x < upper))
        pvalues.append(stats.kstest(x, truncnorm_cdf(lower, upper)).pvalue)
    if ok:
        assert min(pvalues) > ALPHA / 5
    else:
        assert min(pvalues) < POWER


def ordinal_draws(link: lk.OrdinalLink, code: int, n: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty((n, 1))
    link.forward(np.full(n, code, dtype=np.intp), out, rng)
    return out[:, 0]


def test_ordinal_forward_matches_exact_conditional() -> None:
    rng = np.random.default_rng(10)
    link = exact_links().links[2]
    assert isinstance(link, lk.OrdinalLink)
    bounds = np.concatenate([[-np.inf], link.thresholds, [np.inf]])
    for code in range(4):
        z = ordinal_draws(link, code, 10_000, rng)
        cdf = truncnorm_cdf(bounds[code], bounds[code + 1])
        assert stats.kstest(z, cdf).pvalue > ALPHA / 4
        # Broken: the seed-style untruncated draw clipped into the interval is rejected.
        bad = broken_interval_sampler(np.full(10_000, bounds[code]),
                                      np.full(10_000, bounds[code + 1]), rng.uniform(size=10_000))
        assert stats.kstest(bad, cdf).pvalue < POWER


@functools.cache
def top_cdf_knots(locations: tuple[float, ...], chosen: int) -> CubicSpline:
    """Exact CDF of t = u_chosen given its category, by adaptive quadrature between 301 knots
    (independent of the implementation's grid); a cubic spline through the knots is accurate
    to ~1e-7, far below the KS resolution."""
    m = np.asarray(locations)
    others = np.delete(m, chosen)

    def density(t: float) -> float:
        return float(stats.norm.pdf(t - m[chosen]) * np.prod(special.ndtr(t - others)))

    edges = np.linspace(0.0, max(0.0, float(m.max())) + 10.0, 301)
    pieces = [integrate.quad(density, a, b, epsabs=1e-14, epsrel=1e-12)[0]
              for a, b in zip(edges[:-1], edges[1:], strict=True)]
    cumulative = np.concatenate([[0.0], np.cumsum(pieces)])
    return CubicSpline(edges, cumulative / cumulative[-1])


def top_cdf(m: np.ndarray, chosen: int) -> Callable[[np.ndarray], np.ndarray]:
    spline = top_cdf_knots(tuple(float(v) for v in m), chosen)
    top = float(spline.x[-1])
    return lambda x: np.clip(spline(np.clip(x, 0.0, top)), 0.0, 1.0)


def correct_top(link: lk.NominalLink, category: int, u: np.ndarray) -> np.ndarray:
    return link.sample_top(np.full(u.size, category), u)


def broken_top(link: lk.NominalLink, category: int, u: np.ndarray) -> np.ndarray:
    """Planted bug (a literal reading of the seed): t ~ N(m_l, 1) truncated to t > 0, ignoring
    that t must also exceed every other coordinate."""
    m = link.locations[category - 1]
    return np.asarray(m + lk.truncated_normal(np.full(u.size, -m), np.full(u.size, np.inf), u))


@pytest.mark.parametrize("sampler, ok", [(correct_top, True), (broken_top, False)])
def test_nominal_top_coordinate_matches_exact_conditional(
        sampler: Callable[[lk.NominalLink, int, np.ndarray], np.ndarray], ok: bool) -> None:
    rng = np.random.default_rng(11)
    link = exact_links().links[3]
    assert isinstance(link, lk.NominalLink)
    pvalues = []
    for category in (1, 2, 3):
        t = sampler(link, category, rng.uniform(size=10_000))
        pvalues.append(stats.kstest(t, top_cdf(link.locations, category - 1)).pvalue)
    if ok:
        assert min(pvalues) > ALPHA / 3
    else:
        assert min(pvalues) < POWER


def nominal_draws(link: lk.NominalLink, code: int, n: int,
                  rng: np.random.Generator) -> np.ndarray:
    out = np.empty((n, link.width))
    link.forward(np.full(n, code, dtype=np.intp), out, rng)
    return np.asarray(out + link.locations[None, :])  # u = e + m


def test_nominal_other_coordinates_are_truncated_below_the_top() -> None:
    # Given t = u_l, each other u_k is N(m_k, 1) truncated to (-inf, t): the probability
    # integral transform Phi(u_k - m_k) / Phi(t - m_k) is Uniform(0, 1). Category 0: t = 0.
    rng = np.random.default_rng(12)
    link = exact_links().links[3]
    assert isinstance(link, lk.NominalLink)
    m = link.locations
    for code in range(4):
        u = nominal_draws(link, code, 10_000, rng)
        top = np.zeros(u.shape[0]) if code == 0 else u[:, code - 1]
        assert np.all(link.inverse(u - m[None, :]) == code)
        for k in range(3):
            if k == code - 1:
                continue
            pit = special.ndtr(u[:, k] - m[k]) / special.ndtr(top - m[k])
            assert stats.kstest(pit, "uniform").pvalue > ALPHA / 12
            # Broken: an untruncated N(m_k, 1) capped at t gives a non-uniform transform.
            capped = np.minimum(m[k] + rng.standard_normal(u.shape[0]), top)
            bad = special.ndtr(capped - m[k]) / special.ndtr(top - m[k])
            assert stats.kstest(bad, "uniform").pvalue < POWER


def test_nominal_forward_agrees_with_rejection_sampling() -> None:
    # Monte-Carlo check of the whole conditional vector: draw u ~ N(m, I), keep those that
    # decode to the category, compare each coordinate (two-sample KS).
    rng = np.random.default_rng(13)
    link = exact_links().links[3]
    assert isinstance(link, lk.NominalLink)
    m = link.locations
    reference = m[None, :] + rng.standard_normal((60_000, 3))
    labels = link.inverse(reference - m[None, :])
    for code in range(4):
        kept = reference[labels == code][:4000]
        ours = nominal_draws(link, code, 4000, rng)
        for k in range(3):
            assert stats.ks_2samp(kept[:, k], ours[:, k]).pvalue > ALPHA / 12


# --------------------------------------------------------------------------- DP marginals noise


def discrete_laplace_mean_abs(scale: float) -> float:
    a = math.exp(-1.0 / scale)
    return 2.0 * a / ((1.0 + a) * (1.0 - a))  # E|X| for pmf prop. to a^|x|


def histogram_noise(mechanism_factory: Callable[..., object], reps: int) -> np.ndarray:
    rng = np.random.default_rng(14)
    table = make_table(200, rng)
    exact = dm.exact_marginals(table, moments=False)
    noise = []
    original = dm.histogram_mechanism
    dm.histogram_mechanism = mechanism_factory  # type: ignore[assignment]
    try:
        for _ in range(reps):
            rel, _ = dm.release_marginals(table, epsilon=1.5, rng=rng, moments=False)
            noise.append(np.concatenate([rel.counts[k] - exact.counts[k] for k in exact.counts]))
    finally:
        dm.histogram_mechanism = original
    return np.concatenate(noise)


def half_noise_histogram(schema: Schema, epsilon: float) -> object:
    """Planted bug: the old add/remove calibration, L1 = 1 per histogram (half the noise)."""
    return DiscreteLaplaceMechanism(epsilon, 1.0 * len(schema.columns[2:]))


@pytest.mark.parametrize("factory, ok", [(dm.histogram_mechanism, True),
                                         (half_noise_histogram, False)])
def test_histogram_noise_has_the_declared_scale(factory: Callable[..., object], ok: bool) -> None:
    noise = histogram_noise(factory, 400)  # 400 releases x 10 cells
    expected = discrete_laplace_mean_abs(6 / 1.5)  # Delta_1 = 2 x 3 histograms (replace-one)
    ratio = float(np.mean(np.abs(noise))) / expected
    # E|X| has relative standard error ~ sqrt(Var|X|)/E|X|/sqrt(4000) ~ 1.7%.
    if ok:
        assert abs(ratio - 1.0) < 0.08
        assert np.all(noise == np.round(noise))
    else:
        assert ratio < 0.75


@pytest.mark.parametrize("half, ok", [(False, True), (True, False)])
def test_moment_noise_has_the_declared_scale(half: bool, ok: bool) -> None:
    rng = np.random.default_rng(15)
    table = make_table(100, rng)
    exact = dm.exact_marginals(table)
    noise = []
    for _ in range(1000):
        rel, cost = dm.release_marginals(table, epsilon=2.0, rng=rng)
        for k in exact.moments:
            diff = rel.moments[k] - exact.moments[k]
            noise.append(diff * (0.5 if half else 1.0))
    b = float(np.mean(np.abs(np.concatenate(noise))))  # Laplace: E|X| = b
    if ok:  # Delta_1 = 2 x 3 histograms + 9/4 x 2 moment pairs = 10.5
        assert b == pytest.approx(10.5 / 2.0, rel=0.08)
    else:
        assert b < 0.75 * 10.5 / 2.0


def test_dp_mean_variance_and_histogram_converge_in_the_non_private_limit() -> None:
    rng = np.random.default_rng(16)
    y = rng.normal(40, 10, 5000)
    mean, var, cost = dm.dp_mean_variance(y, 0, 100, epsilon=1e9, rng=rng)
    clipped = np.clip(y, 0, 100)
    assert mean == pytest.approx(clipped.mean(), rel=1e-6)
    assert var == pytest.approx(clipped.var(), rel=1e-5)
    assert cost.epsilon == 1e9 and cost.sensitivity == 2.25
    counts, cost = dm.dp_histogram(np.array([0, 1, 1, 2]), 3, epsilon=1e9, rng=rng)
    np.testing.assert_array_equal(counts, [1, 2, 1])


def test_combined_links_from_several_sites() -> None:
    rng = np.random.default_rng(17)
    tables = [make_table(30_000, rng) for _ in range(3)]
    releases = [lk.fit_link_statistics(t, epsilon=5.0, rng=rng)[0] for t in tables]
    total = dm.sum_releases(releases)
    assert total.n_rows == 90_000 and total.n_sites == 3
    links = lk.combine_link_statistics(make_schema(), releases)
    ordinal = links.links[2]
    assert isinstance(ordinal, lk.OrdinalLink)
    np.testing.assert_allclose(ordinal.proportions, SEVERITY, atol=0.01)
    age = links.links[0]
    assert isinstance(age, lk.ContinuousLink) and age.standard_normal
    assert age.mean == pytest.approx(0.0, abs=0.02)  # uniform on the bounds
    assert age.sd == pytest.approx(1 / math.sqrt(3), abs=0.02)
    assert links.standard_normal.tolist() == [True] * links.dim
    bounds = lk.combine_link_statistics(
        make_schema(), [lk.fit_link_statistics(t, epsilon=5.0, rng=rng,
                                               continuous_scaling="bounds")[0] for t in tables],
        continuous_scaling="bounds")
    assert bounds.standard_normal.tolist() == [False, False] + [True] * 5


def test_generator_source_is_uniform_beyond_int64() -> None:
    src = dm.GeneratorSource(np.random.default_rng(18))
    n = 3 * (1 << 64)
    draws = [src.randbelow(n) for _ in range(3000)]
    assert all(0 <= d < n for d in draws)
    counts = np.bincount([d >> 64 for d in draws], minlength=3)
    assert stats.chisquare(counts).pvalue > ALPHA
    assert {src.randbelow(2) for _ in range(50)} == {0, 1}
    with pytest.raises(ValidationError):
        src.randbelow(0)


# --------------------------------------------------------------------------- unit ball


def test_clip_to_unit_ball() -> None:
    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    unit, clipped = lk.clip_to_unit_ball(x, 2.0)
    assert clipped == 1
    np.testing.assert_allclose(unit, [[0.6, 0.8], [0.15, 0.2], [0.0, 0.0]])
    assert lk.default_clip_norm(9) == 3.0
    assert lk.latent_dim(make_schema()) == 7
