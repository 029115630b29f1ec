"""Exact discrete Laplace / discrete Gaussian samplers (CKS 2020) and their mechanisms.

Three layers: validation; cost arithmetic (no randomness); seeded statistical tests (chi^2
goodness of fit against the exact pmf), each also run against a deliberately broken sampler
that the same test must reject.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

import pytest
from scipy import stats

from dpfed.common.errors import ValidationError
from dpfed.common.privacy import exact_samplers as es
from dpfed.common.privacy.accounting import zcdp_to_epsilon

SEEDS = (0, 1, 2, 3, 4)
N_DRAWS = 20_000
ALPHA = 1e-3  # per-seed acceptance level of the chi^2 test


def chi2_pvalue(draws: list[int], pmf: Callable[[int], float],
                min_expected: float = 20.0) -> float:
    """Chi^2 goodness of fit of integer draws to a symmetric pmf on the integers.

    Bins: every integer in [-k, k] with expected count >= ``min_expected``, plus the two
    tails (< -k and > k) merged into one bin each.
    """
    n = len(draws)
    counts = Counter(draws)
    k = 0
    while n * pmf(k + 1) >= min_expected:
        k += 1
    central = [pmf(x) for x in range(-k, k + 1)]
    tail = (1.0 - math.fsum(central)) / 2.0
    expected = [n * tail, *(n * p for p in central), n * tail]
    observed = [
        sum(v for x, v in counts.items() if x < -k),
        *(counts.get(x, 0) for x in range(-k, k + 1)),
        sum(v for x, v in counts.items() if x > k),
    ]
    return float(stats.chisquare(observed, expected).pvalue)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1, -0.5, 0.0, math.nan, math.inf, -math.inf, True, "2",
                                 None, Fraction(-1, 3)])
def test_sampler_parameters_are_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="scale"):
        es.sample_discrete_laplace(bad, rng=random.Random(0))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="sigma2"):
        es.sample_discrete_gaussian(bad, rng=random.Random(0))  # type: ignore[arg-type]


def test_bernoulli_exp_accepts_zero_but_not_negative() -> None:
    assert es.sample_bernoulli_exp(0, rng=random.Random(0)) is True
    with pytest.raises(ValidationError, match="gamma must be finite and >= 0"):
        es.sample_bernoulli_exp(-0.1, rng=random.Random(0))


@pytest.mark.parametrize("bad_size", [-1, 2.0, True, "3"])
def test_many_size_is_validated(bad_size: object) -> None:
    with pytest.raises(ValidationError, match="size"):
        es.sample_discrete_laplace_many(1, bad_size, rng=random.Random(0))  # type: ignore[arg-type]


def test_rng_must_have_randbelow() -> None:
    with pytest.raises(ValidationError, match="rng must be"):
        es.sample_discrete_laplace(1, rng=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("eps", [0, -1.0, math.nan, math.inf, "1", None])
def test_mechanisms_validate_epsilon(eps: object) -> None:
    with pytest.raises(ValidationError, match="epsilon"):
        es.DiscreteLaplaceMechanism(eps)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="epsilon"):
        es.DiscreteGaussianMechanism(eps, 1e-6)  # type: ignore[arg-type]


@pytest.mark.parametrize("delta", [0, 1, -1e-5, math.nan, 1.5])
def test_discrete_gaussian_validates_delta(delta: float) -> None:
    with pytest.raises(ValidationError, match="delta"):
        es.DiscreteGaussianMechanism(1.0, delta)


@pytest.mark.parametrize("sens", [0, -1, math.nan, math.inf])
def test_mechanisms_validate_sensitivity(sens: float) -> None:
    with pytest.raises(ValidationError, match="sensitivity"):
        es.DiscreteLaplaceMechanism(1.0, sens)
    with pytest.raises(ValidationError, match="sensitivity"):
        es.DiscreteGaussianMechanism(1.0, 1e-6, sens)


@pytest.mark.parametrize("value", [1.5, 2.0, True, "3", None])
def test_release_requires_integers(value: object) -> None:
    mech = es.DiscreteLaplaceMechanism(1.0)
    with pytest.raises(ValidationError, match="value"):
        mech.release(value, random.Random(0))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"values\[1\]"):
        mech.release_many([1, value], random.Random(0))  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="values must be a sequence"):
        mech.release_many(5, random.Random(0))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- cost arithmetic


def test_discrete_laplace_scale_is_exact_ratio() -> None:
    mech = es.DiscreteLaplaceMechanism(0.1, 2)
    assert mech.scale == Fraction(2) / Fraction(0.1)  # exact rational of the given doubles
    cost = mech.cost()
    assert cost.epsilon == 0.1 and cost.delta == 0.0
    assert cost.rho == pytest.approx(0.1**2 / 2, rel=1e-15)
    assert cost.mechanism == "discrete-laplace" and cost.sensitivity == 2.0
    assert cost.noise_scale == pytest.approx(20.0)


@pytest.mark.parametrize(("eps", "delta", "sens"), [(1.0, 1e-5, 1.0), (0.3, 1e-7, 2.0),
                                                    (5.0, 1e-6, 1.0)])
def test_discrete_gaussian_calibration_never_overspends(eps: float, delta: float,
                                                        sens: float) -> None:
    mech = es.DiscreteGaussianMechanism(eps, delta, sens)
    assert isinstance(mech.sigma2, Fraction)
    assert mech.sigma2.denominator <= 2**32
    assert mech.rho == pytest.approx(sens**2 / (2 * float(mech.sigma2)), rel=1e-15)
    # The (epsilon, delta) the ledger reports is met (rounding only adds noise) ...
    assert zcdp_to_epsilon(mech.rho, delta) <= eps
    # ... and not wastefully: within 1e-6 relative of the budget.
    assert zcdp_to_epsilon(mech.rho, delta) == pytest.approx(eps, rel=1e-6)
    cost = mech.cost()
    assert (cost.epsilon, cost.delta, cost.rho) == (eps, delta, mech.rho)
    assert cost.mechanism == "discrete-gaussian"


# --------------------------------------------------------------------------- determinism, types


def test_outputs_are_python_ints_and_seeded_sources_are_reproducible() -> None:
    a = es.sample_discrete_laplace_many(Fraction(7, 3), 50, rng=es.SeededRandomSource(11))
    b = es.sample_discrete_laplace_many(Fraction(7, 3), 50, rng=random.Random(11))
    assert a == b and all(type(x) is int for x in a)
    g = es.sample_discrete_gaussian_many(2.5, 50, rng=random.Random(3))
    assert g == es.sample_discrete_gaussian_many(2.5, 50, rng=random.Random(3))
    assert all(type(x) is int for x in g)
    assert es.sample_discrete_laplace_many(1, 0) == []


def test_default_source_is_secrets() -> None:
    assert isinstance(es.resolve_source(None), es.SystemRandomSource)
    x = es.DiscreteLaplaceMechanism(1.0).release(10)  # secrets-driven, value not asserted
    assert type(x) is int
    y = es.DiscreteGaussianMechanism(1.0, 1e-5).release_many([1, 2, 3])
    assert len(y) == 3 and all(type(v) is int for v in y)


def test_pmfs_sum_to_one() -> None:
    assert math.fsum(es.discrete_laplace_pmf(x, 2.5) for x in range(-400, 401)) == pytest.approx(
        1.0, abs=1e-12)
    assert math.fsum(es.discrete_gaussian_pmf(x, Fraction(9, 2)) for x in range(-100, 101)) == (
        pytest.approx(1.0, abs=1e-12))


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("gamma", [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(5, 3),
                                   Fraction(27, 10)])
def test_bernoulli_exp_frequency(gamma: Fraction) -> None:
    rng = random.Random(5)
    n = 20_000
    hits = sum(es.sample_bernoulli_exp(gamma, rng=rng) for _ in range(n))
    p = math.exp(-float(gamma))
    # Two-sided exact binomial test at 1e-4; exp(0) = 1 must give all successes.
    assert stats.binomtest(hits, n, p).pvalue > 1e-4


# Integer/rational parameters over five seeds; a float parameter (exact dyadic rational with a
# 2^50-sized denominator, the path a float epsilon takes) over two.
@pytest.mark.parametrize(("scale", "seeds"), [(Fraction(3), SEEDS), (1 / 0.3, SEEDS[:2])])
def test_discrete_laplace_matches_pmf(scale: Fraction | float, seeds: tuple[int, ...]) -> None:
    pvalues = [chi2_pvalue(es.sample_discrete_laplace_many(scale, N_DRAWS, rng=random.Random(s)),
                           lambda x: es.discrete_laplace_pmf(x, scale)) for s in seeds]
    assert min(pvalues) > ALPHA, pvalues


@pytest.mark.parametrize(("sigma2", "seeds"), [(Fraction(9, 2), SEEDS), (0.7, SEEDS[:2])])
def test_discrete_gaussian_matches_pmf(sigma2: Fraction | float, seeds: tuple[int, ...]) -> None:
    pvalues = [chi2_pvalue(es.sample_discrete_gaussian_many(sigma2, N_DRAWS,
                                                             rng=random.Random(s)),
                           lambda x: es.discrete_gaussian_pmf(x, sigma2)) for s in seeds]
    assert min(pvalues) > ALPHA, pvalues


@pytest.mark.parametrize("factor", [Fraction(1, 2), Fraction(9, 10)])
def test_chi2_rejects_wrong_scale(factor: Fraction) -> None:
    # Broken copies: the right algorithm at the wrong scale (half the noise is the DP bug;
    # 10% off shows the test's resolution). Same test, same draw count, must reject.
    lap = es.sample_discrete_laplace_many(3 * factor, N_DRAWS, rng=random.Random(0))
    assert chi2_pvalue(lap, lambda x: es.discrete_laplace_pmf(x, 3)) < 1e-9
    gau = es.sample_discrete_gaussian_many(Fraction(9, 2) * factor, N_DRAWS,
                                           rng=random.Random(0))
    assert chi2_pvalue(gau, lambda x: es.discrete_gaussian_pmf(x, Fraction(9, 2))) < 1e-9


def _broken_discrete_laplace_counts_zero_twice(t: int, src: es.RandomSource) -> int:
    """CKS Alg. 2 without step 7: -0 is not rejected, so 0 is twice as likely as it should be."""
    while True:
        u = src.randbelow(t)
        if not es._bernoulli_exp(u, t, src):
            continue
        v = es._geometric_exp_minus_one(src)
        y = u + t * v
        return -y if src.randbelow(2) == 1 else y


def test_chi2_rejects_a_subtly_broken_sampler() -> None:
    src = es.SeededRandomSource(0)
    draws = [_broken_discrete_laplace_counts_zero_twice(3, src) for _ in range(N_DRAWS)]
    assert chi2_pvalue(draws, lambda x: es.discrete_laplace_pmf(x, 3)) < 1e-9


def test_mechanism_release_is_centred_noise() -> None:
    mech = es.DiscreteLaplaceMechanism(0.5, 1)  # scale 2
    rng = random.Random(9)
    noise = [mech.release(100, rng) - 100 for _ in range(N_DRAWS)]
    assert chi2_pvalue(noise, lambda x: es.discrete_laplace_pmf(x, 2)) > ALPHA
    gmech = es.DiscreteGaussianMechanism(1.0, 1e-5)
    gnoise = [v - 7 for v in gmech.release_many([7] * 5_000, rng)]
    assert chi2_pvalue(gnoise, lambda x: es.discrete_gaussian_pmf(x, gmech.sigma2)) > ALPHA
