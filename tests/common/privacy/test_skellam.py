"""The Skellam accountant is an upper bound on the true Renyi divergence (checked numerically
against the exact pmf), converges to the Gaussian's, calibrates tightly, and the noise a sum of
site shares carries has the accountant's variance (a half-noise copy is caught)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import zcdp_to_epsilon
from dpfed.common.privacy.skellam import (
    skellam_calibrate,
    skellam_epsilon,
    skellam_noise,
    skellam_rdp,
    skellam_rho,
    skellam_share,
)


def _exact_renyi(alpha: int, mu: float, shift: int) -> float:
    """D_alpha(Sk(mu) || Sk(mu) + shift) from the exact pmf (e^-mu I_k(mu))."""
    half_width = int(12 * math.sqrt(mu) + 40 + shift)  # beyond it both pmfs are negligible
    k = np.arange(-half_width, half_width + 1)
    logp = np.log(special.ive(np.abs(k), mu))  # ive = I_k(mu) e^-mu
    logq = np.log(special.ive(np.abs(k - shift), mu))
    terms = alpha * logp + (1 - alpha) * logq
    return float(special.logsumexp(terms) / (alpha - 1))


@pytest.mark.parametrize("mu", [2.0, 10.0, 100.0])
@pytest.mark.parametrize("shift", [1, 3])
def test_accountant_bounds_the_exact_divergence(mu: float, shift: int) -> None:
    for alpha in (2, 3, 5, 10, 20):
        exact = _exact_renyi(alpha, mu, shift)
        bound = skellam_rdp(alpha, mu, float(shift), float(shift))
        assert bound >= exact * (1 - 1e-9), (alpha, mu, shift, bound, exact)


def test_a_half_noise_accountant_is_caught() -> None:
    def broken(alpha: int, mu: float, l2: float) -> float:
        return alpha * l2 * l2 / (4 * mu)  # planted: half the divergence, no surcharge

    violations = [(a, mu) for mu in (2.0, 10.0, 100.0) for a in (2, 5, 10)
                  if broken(a, mu, 1.0) < _exact_renyi(a, mu, 1)]
    assert violations


def test_large_variance_approaches_the_gaussian() -> None:
    # Integer sensitivity 100 (a fixed-point scale of 100), variance chosen for epsilon ~ 1.
    l2, delta = 100.0, 1e-5
    mu = l2 * l2 / (2 * 0.03)
    gauss = zcdp_to_epsilon(l2 * l2 / (2 * mu), delta)
    assert skellam_epsilon(mu, delta, l2, l2) == pytest.approx(gauss, rel=0.01)
    assert skellam_epsilon(mu, delta, l2, l2) >= gauss * (1 - 1e-6)


def test_calibration_is_tight_and_monotone() -> None:
    cal = skellam_calibrate(1.0, 1e-5, 40.0, 300.0)
    assert cal.achieved_epsilon <= 1.0
    assert skellam_epsilon(cal.mu * (1 - 1e-6), 1e-5, 40.0, 300.0) > 1.0
    assert skellam_epsilon(cal.mu * 2, 1e-5, 40.0, 300.0) < cal.achieved_epsilon
    cost = cal.cost()
    assert cost.epsilon == 1.0 and cost.mechanism == "skellam"
    assert cost.rho == pytest.approx(skellam_rho(cal.mu, 40.0, 300.0))
    # rho is valid: every order's RDP is at most alpha * rho
    for a in (2, 10, 100):
        assert skellam_rdp(a, cal.mu, 40.0, 300.0) <= a * cost.rho * (1 + 1e-12)


def test_shares_and_their_errors() -> None:
    assert skellam_share(100.0, 4, 0) == 25.0
    assert skellam_share(100.0, 4, 2) == 50.0
    with pytest.raises(ValidationError, match="more than 4 participating"):
        skellam_share(100.0, 4, 4)
    with pytest.raises(ValidationError):
        skellam_rdp(1, 10.0, 1.0, 1.0)
    with pytest.raises(ValidationError, match="cannot be smaller"):
        skellam_rdp(2, 10.0, 2.0, 1.0)


def _variance_p_value(draws: np.ndarray, mu: float) -> float:
    n = draws.size
    stat = float(np.sum(draws.astype(np.float64) ** 2) / mu)  # ~ chi2(n) for mean-0 noise
    return float(2 * min(stats.chi2.cdf(stat, n), stats.chi2.sf(stat, n)))


def test_sum_of_site_shares_has_the_target_variance_and_half_noise_is_caught() -> None:
    rng = np.random.default_rng(7)
    mu, sites = 5000.0, 4
    share = skellam_share(mu, sites, 0)
    total = sum(skellam_noise(40_000, share, rng) for _ in range(sites))
    assert total.dtype == np.int64
    assert _variance_p_value(total, mu) > 1e-3
    half = sum(skellam_noise(40_000, share / 2, rng) for _ in range(sites))  # planted
    assert _variance_p_value(half, mu) < 1e-6
