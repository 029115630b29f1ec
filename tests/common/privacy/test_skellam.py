"""The Skellam accountant is an upper bound on the true Renyi divergence (checked numerically
against the exact pmf), converges to the Gaussian's, calibrates tightly to both of its targets
(the (epsilon, delta) and the Gaussian's rho -- a search over the secure sums' sensitivities and
the zCDP rounds' budgets; a copy without the rho target is caught), and the noise a sum of site
shares carries has the accountant's variance (a half-noise copy is caught)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import special, stats

from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SYNTH_PAIRS_DEFAULT_SPLIT
from dpfed.common.privacy.accounting import rho_for_epsilon, zcdp_to_epsilon
from dpfed.common.privacy.composition import round_rho, split_budget
from dpfed.common.privacy.skellam import (
    SkellamCalibration,
    _smallest_variance,
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


def _budgets() -> list[tuple[float, float]]:
    """Plain (epsilon, delta) targets and every round of the synth job composed in zCDP."""
    out = [(e, d) for e in (0.05, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0) for d in (1e-10, 1e-6, 1e-3)]
    shares = [(n, e, d) for n, (e, d) in SYNTH_PAIRS_DEFAULT_SPLIT.items()]
    for eps in (0.5, 1.0, 2.0, 5.0, 10.0):
        out += [(e, d) for _, e, d in split_budget(eps, 1e-6, shares, "zcdp")]
    return out


#: (L2, L1) of the secure sums: counts of C groups (sqrt(2C), 2C), scores of P pairs moving by
#: 2 (2 sqrt(P), 2P), a Gram at a fixed-point scale (sqrt(2) B^2, (d + 1) B^2).
_SENSITIVITIES = ([(math.sqrt(2 * c), 2.0 * c) for c in (1, 3, 12, 200, 5000)]
                  + [(2 * math.sqrt(p), 2.0 * p) for p in (1, 10, 190)]
                  + [(math.sqrt(2) * b * b, 21.0 * b * b) for b in (3.0, 1e3)])


def _violations(calibrate: Callable[[float, float, float, float], SkellamCalibration]
                ) -> list[tuple[float, ...]]:
    bad = []
    for eps, delta in _budgets():
        for l2, l1 in _SENSITIVITIES:
            mu = calibrate(eps, delta, l2, l1).mu
            rho, cap = skellam_rho(mu, l2, l1), round_rho(eps, delta)
            if skellam_epsilon(mu, delta, l2, l1) > eps * (1 + 1e-12) or rho > cap * (1 + 1e-9):
                bad.append((eps, delta, l2, l1, rho / cap))
    return bad


def test_calibration_meets_both_targets_and_is_tight_over_a_search() -> None:
    assert _violations(skellam_calibrate) == []
    for eps, delta in _budgets()[::4]:
        for l2, l1 in _SENSITIVITIES[::2]:
            mu = skellam_calibrate(eps, delta, l2, l1).mu * (1 - 1e-6)
            # tight: a hair less noise misses one of the targets
            assert (skellam_epsilon(mu, delta, l2, l1) > eps
                    or skellam_rho(mu, l2, l1) > round_rho(eps, delta)), (eps, delta, l2, l1)


def test_a_calibration_without_the_rho_target_is_caught() -> None:
    def epsilon_only(eps: float, delta: float, l2: float, l1: float) -> SkellamCalibration:
        mu = _smallest_variance(lambda m: skellam_epsilon(m, delta, l2, l1) <= eps, l2, "")
        return SkellamCalibration(mu, eps, delta, l2, l1, skellam_epsilon(mu, delta, l2, l1))

    bad = _violations(epsilon_only)
    assert bad and max(v[-1] for v in bad) > 1.5  # small sensitivities at epsilon >= 2


def test_secure_rounds_of_a_zcdp_job_add_up_to_at_most_its_rho() -> None:
    shares = [(n, e, d) for n, (e, d) in SYNTH_PAIRS_DEFAULT_SPLIT.items()]
    for eps in (0.5, 1.0, 5.0, 20.0):
        rounds = split_budget(eps, 1e-6, shares, "zcdp")
        for l2, l1 in _SENSITIVITIES:
            total = sum(skellam_calibrate(e, d, l2, l1).cost().rho for _, e, d in rounds)
            assert total <= rho_for_epsilon(eps, 1e-6)
            assert zcdp_to_epsilon(total, 1e-6) <= eps * (1 + 1e-9)


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
