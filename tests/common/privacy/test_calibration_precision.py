"""Float-level calibration: every calibration in dpfed.common.privacy against 60-digit arithmetic.

A fuzzed grid of (epsilon, delta, sensitivity), extremes included, through the real functions;
the oracle recomputes each guarantee with mpmath at 60 digits (or exact rationals). The double
evaluation of the Gaussian's delta loses up to 1.7e-10 of its value where its two terms nearly
cancel (issue 19): a copy that calibrates on the plain double value, and a Laplace scale taken
as the rounded quotient, are both caught.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import mpmath
import pytest
from scipy import optimize, special

from dpfed.common.privacy import lattice_gdp
from dpfed.common.privacy.accounting import rho_for_epsilon, zcdp_to_epsilon
from dpfed.common.privacy.exact_samplers import DiscreteGaussianMechanism, DiscreteLaplaceMechanism
from dpfed.common.privacy.mechanisms import LaplaceMechanism, gaussian_sigma, laplace_scale
from dpfed.common.privacy.skellam import skellam_calibrate, skellam_infinity_mass

mpmath.mp.dps = 60
ISSUE_19 = (0.0014221039415135439, 3.3515213590171105e-14, 24.59089565961929)


def _exact_gaussian_delta(sigma: float, eps: float, sens: float) -> mpmath.mpf:
    s, e, d = mpmath.mpf(sigma), mpmath.mpf(eps), mpmath.mpf(sens)
    a, b = d / (2 * s), e * s / d
    return mpmath.ncdf(a - b) - mpmath.exp(e) * mpmath.ncdf(-a - b)


def _grid(n: int, seed: int) -> list[tuple[float, float, float]]:
    rnd = random.Random(seed)
    out = [ISSUE_19, (1e-6, 1e-300, 1.0), (50.0, 0.5, 1e-9), (1e-6, 0.5, 1e9),
           (50.0, 1e-300, 1e6), (1e-4, 1e-12, 3.0), (0.01, 1e-15, 7.0)]
    for _ in range(n):
        out.append((10 ** rnd.uniform(-6, math.log10(50)), 10 ** rnd.uniform(-300, -0.4),
                    10 ** rnd.uniform(-6, 6)))
    return out


def _old_sigma(eps: float, delta: float, sens: float) -> float:
    """Planted: the calibration before issue 19 (ulp steps on the plain double delta)."""
    def plain(sigma: float) -> float:
        a, b = 1.0 / (2.0 * sigma), eps * sigma
        first = float(special.ndtr(a - b))
        return max(first - math.exp(eps + float(special.log_ndtr(-a - b))), 0.0)

    def gap(log_sigma: float) -> float:
        return math.log(max(plain(math.exp(log_sigma)), 1e-300)) - math.log(delta)

    lo, hi = math.log(1e-6), math.log(10.0)
    while gap(lo) < 0:
        lo -= 5.0
    while gap(hi) > 0:
        hi += 5.0
    sigma = math.exp(optimize.brentq(gap, lo, hi, xtol=1e-15, rtol=4 * 2.0 ** -52,
                                     maxiter=500))
    while plain(sigma) > delta:
        sigma = math.nextafter(sigma, math.inf)
    return sens * sigma


def test_the_analytic_gaussian_is_never_below_its_delta() -> None:
    bad = []
    for eps, delta, sens in _grid(60, 19):
        sigma = gaussian_sigma(eps, delta, sens)
        if _exact_gaussian_delta(sigma, eps, sens) > delta:
            bad.append((eps, delta, sens))
    assert bad == []
    # and it is tight: a 1e-6 relative hair less noise misses (away from delta ~ 1)
    eps, delta, sens = ISSUE_19
    assert _exact_gaussian_delta(gaussian_sigma(eps, delta, sens) * (1 - 1e-6), eps,
                                 sens) > delta


def test_the_old_double_calibration_is_caught() -> None:
    eps, delta, sens = ISSUE_19
    sigma = _old_sigma(eps, delta, sens)
    excess = (_exact_gaussian_delta(sigma, eps, sens) - delta) / delta
    assert excess > 1e-10  # issue 19: 1.67e-10 above the target


def test_laplace_scales_are_never_below_the_exact_ratio() -> None:
    rounded_down = 0
    for eps, _, sens in _grid(400, 7):
        scale = laplace_scale(eps, sens)
        assert Fraction(sens) / Fraction(scale) <= Fraction(eps)
        assert LaplaceMechanism(eps, sens).scale == scale
        assert scale <= math.nextafter(sens / eps, math.inf)  # at most one ulp of noise more
        rounded_down += Fraction(sens) / Fraction(sens / eps) > Fraction(eps)
    assert rounded_down > 0  # the plain quotient would have given more than epsilon


def test_discrete_laplace_is_exact_and_discrete_gaussian_converts_within_epsilon() -> None:
    for eps, delta, sens in _grid(30, 3):
        assert Fraction(sens) / DiscreteLaplaceMechanism(eps, sens).scale == Fraction(eps)
        if delta < 1e-200 or eps > 20:
            continue  # sigma^2 beyond the exact sampler's rational grid
        mech = DiscreteGaussianMechanism(eps, delta, sens)
        rho = Fraction(sens) ** 2 / (2 * mech.sigma2)
        assert _exact_zcdp_epsilon(rho, delta) <= eps


def _exact_zcdp_epsilon(rho: Fraction | float, delta: float) -> mpmath.mpf:
    """inf over a > 1 of CKS 2020 Cor. 13, to 40 digits (golden section on ln(a - 1))."""
    r, dl = mpmath.mpf(rho.numerator) / rho.denominator if isinstance(rho, Fraction) else \
        mpmath.mpf(rho), mpmath.mpf(delta)

    def bound(t: mpmath.mpf) -> mpmath.mpf:
        a = 1 + mpmath.exp(t)
        return a * r + (mpmath.log(1 / dl) + (a - 1) * mpmath.log(1 - 1 / a) - mpmath.log(a)) / (
            a - 1)

    lo, hi = mpmath.mpf(-30), mpmath.mpf(30)
    g = (mpmath.sqrt(5) - 1) / 2
    for _ in range(300):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if bound(m1) < bound(m2):
            hi = m2
        else:
            lo = m1
    return min(bound((lo + hi) / 2), r + 2 * mpmath.sqrt(r * mpmath.log(1 / dl)))


def test_the_zcdp_conversion_never_reports_less_than_the_exact_infimum() -> None:
    rnd = random.Random(13)
    for _ in range(25):
        rho, delta = 10 ** rnd.uniform(-8, 1.5), 10 ** rnd.uniform(-15, -2)
        assert zcdp_to_epsilon(rho, delta) >= _exact_zcdp_epsilon(rho, delta) * (1 - 1e-12)
        eps = 10 ** rnd.uniform(-3, 1)
        assert _exact_zcdp_epsilon(rho_for_epsilon(eps, delta) * (1 - 1e-9), delta) <= eps


def test_skellam_calibrations_meet_their_delta_exactly() -> None:
    for eps, delta, l2 in [(0.0014, 3.4e-14, 25.0), (1.0, 1e-6, 1.0), (0.01, 1e-12, 400.0),
                           (5.0, 1e-9, 1.5e6), (30.0, 1e-3, 2.0)]:
        cal = skellam_calibrate(eps, delta, l2, l2)
        mu = lattice_gdp.skellam_gdp(cal.mu).unit * l2
        exact = _exact_gaussian_delta(1.0 / mu, eps, 1.0)
        assert exact + skellam_infinity_mass(cal.mu, l2, l2) <= delta, (eps, delta, l2)


@pytest.mark.parametrize("eps, delta, sens", [ISSUE_19])
def test_the_issue_19_case(eps: float, delta: float, sens: float) -> None:
    assert _exact_gaussian_delta(gaussian_sigma(eps, delta, sens), eps, sens) <= delta
