"""The Skellam mechanism: integer noise for sums computed under secure aggregation.

A symmetric Skellam variable ``Sk(mu)`` is the difference of two independent Poisson(mu/2)
variables: integer-valued, mean 0, variance ``mu``. A sum of independent Skellams is a
Skellam whose variance is the sum of the variances, so S sites that each add ``Sk(mu/S)`` to
their integer contribution give a masked sum carrying exactly ``Sk(mu)`` -- the property that
lets every site add only a share of the noise when the coordinator sees nothing but the sum.

Privacy
-------
Sensitivities and ``mu`` are in the *integer* domain (after the fixed-point scaling of
:mod:`dpfed.common.secagg.fixed_point`); neighbouring sums differ by an integer vector ``v``
with ``||v||_2 <= l2`` and ``||v||_1 <= l1``.

*(epsilon, delta)*: exact. ``Sk(mu)`` noise on such a query is dominated by the
``unit(mu) l2``-GDP pair plus a negligible mass at ``+inf``
(:func:`dpfed.common.privacy.lattice_gdp.skellam_gdp`: the probit increments of the exact
Skellam pmf, verified over its whole window), and a ``mu``-GDP pair is (epsilon, delta)-DP
exactly when the analytic Gaussian condition holds (Balle & Wang 2018, Thm. 8). So the
Skellam is calibrated like the analytic Gaussian with ``sigma = sqrt(mu) / c(mu)``, where
``c(mu) = unit(mu) sqrt(mu)`` is about ``1 + 1/(6 mu)`` (at most 1.007 for the variances secure
sums use): the pooled noise is within 1 % of a central analytic Gaussian at the same
(epsilon, delta). The tight ledger accountant charges exactly this pair.

*zCDP rho* (for ``zcdp`` ledgers): Agarwal, Kairouz & Liu, *The Skellam Mechanism for
Differentially Private Federated Learning*, NeurIPS 2021, Thm. 3.5: ``Sk(mu)`` is
``(alpha, epsilon_alpha)``-RDP for every ``alpha > 1`` with
``epsilon_alpha = alpha l2^2/(2 mu) + min(((2 alpha - 1) l2^2 + 6 l1)/(4 mu^2), 3 l1/(2 mu))``;
the surcharge is at most ``alpha`` times ``min((l2^2 + 3 l1)/(2 mu^2), 3 l1/(2 mu))``, so the
release is ``rho``-zCDP with ``rho = l2^2/(2 mu) + min((l2^2 + 3 l1)/(2 mu^2), 3 l1/(2 mu))``.

Calibration (:func:`skellam_calibrate`) asks for both: the (epsilon, delta) target, and a rho
no larger than that of the analytic Gaussian calibrated to the same (epsilon, delta)
(:func:`dpfed.common.privacy.composition.round_rho`). The second makes a Skellam round
interchangeable with the Gaussian round it stands for on a ``zcdp`` ledger: a job composed in
zCDP hands every round the (epsilon_i, delta_i) whose Gaussian costs its share rho_i, so its
secure rounds never charge more than the job's rho. It binds when the integer surcharge is
large against the Gaussian term (small sensitivities, a few counts).

Sampling uses numpy's Poisson sampler from a per-release generator: floating-point grade, like
every other matrix release in dpfed (exact samplers are used for scalar counts only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.composition import round_rho
from dpfed.common.privacy.lattice_gdp import GRID_PER_OCTAVE, skellam_gdp
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.pld import epsilon_at
from dpfed.common.validation import check_delta, check_int, check_positive

__all__ = [
    "SkellamCalibration",
    "skellam_calibrate",
    "skellam_epsilon",
    "skellam_gaussian_mu",
    "skellam_infinity_mass",
    "skellam_noise",
    "skellam_rdp",
    "skellam_rho",
    "skellam_share",
]

def _check_sensitivities(l2: float, l1: float) -> tuple[float, float]:
    l2 = check_positive(l2, "l2_sensitivity")
    l1 = check_positive(l1, "l1_sensitivity")
    if l1 < l2 * (1 - 1e-12):
        raise ValidationError(f"l1_sensitivity ({l1:g}) cannot be smaller than "
                              f"l2_sensitivity ({l2:g})")
    return l2, l1


def skellam_rdp(alpha: int, mu: float, l2: float, l1: float) -> float:
    """Return the RDP epsilon of ``Sk(mu)`` noise at integer order ``alpha`` (see module doc)."""
    a = check_int(alpha, "alpha", minimum=2)
    m = check_positive(mu, "mu")
    l2, l1 = _check_sensitivities(l2, l1)
    surcharge = min(((2 * a - 1) * l2 * l2 + 6 * l1) / (4 * m * m), 3 * l1 / (2 * m))
    return a * l2 * l2 / (2 * m) + surcharge


def skellam_gaussian_mu(mu: float, l2: float) -> float:
    """Return the GDP parameter ``unit(mu) * l2`` that dominates ``Sk(mu)`` on this query."""
    return skellam_gdp(check_positive(mu, "mu")).unit * check_positive(l2, "l2_sensitivity")


def skellam_infinity_mass(mu: float, l2: float, l1: float) -> float:
    """Return the ``+inf`` mass of the dominating pair (beyond the verified window).

    At most ``min(l1, l2^2)`` coordinates move (each by an integer ``>= 1``), each by at most
    ``min(l2, l1)``. Below 1e-200 for every variance a secure sum uses.
    """
    l2, l1 = _check_sensitivities(l2, l1)
    return skellam_gdp(check_positive(mu, "mu")).tail_mass(min(l2, l1), min(l1, l2 * l2))


def skellam_epsilon(mu: float, delta: float, l2: float, l1: float) -> float:
    """Return the epsilon at which ``Sk(mu)`` noise on a query of these sensitivities is DP.

    ``inf`` when ``delta`` is not above the dominating pair's ``+inf`` mass.
    """
    dl = check_delta(delta)
    inf = skellam_infinity_mass(mu, l2, l1)
    if inf >= dl:
        return math.inf
    return epsilon_at(dl, mu=skellam_gaussian_mu(mu, l2), loss=None, infinity=inf)


def skellam_rho(mu: float, l2: float, l1: float) -> float:
    """Return a zCDP rho valid for ``Sk(mu)`` noise on a query of these sensitivities."""
    m = check_positive(mu, "mu")
    l2, l1 = _check_sensitivities(l2, l1)
    return l2 * l2 / (2 * m) + min((l2 * l2 + 3 * l1) / (2 * m * m), 3 * l1 / (2 * m))


@dataclass(frozen=True)
class SkellamCalibration:
    """The noise variance that makes one release ``(epsilon, delta)``-DP.

    Attributes
    ----------
    mu : float
        Total variance per coordinate (integer domain) the released sum must carry.
    epsilon, delta : float
        The target; ``achieved_epsilon <= epsilon``.
    l2_sensitivity, l1_sensitivity : float
        Sensitivities in the integer domain.
    achieved_epsilon : float
        The exact epsilon of ``Sk(mu)`` at ``delta`` (:func:`skellam_epsilon`).
    """

    mu: float
    epsilon: float
    delta: float
    l2_sensitivity: float
    l1_sensitivity: float
    achieved_epsilon: float

    def cost(self) -> PrivacyCost:
        """Return the cost a ledger records (epsilon, delta and a valid rho)."""
        return PrivacyCost(self.epsilon, self.delta,
                           skellam_rho(self.mu, self.l2_sensitivity, self.l1_sensitivity),
                           "skellam", self.l2_sensitivity, math.sqrt(self.mu))


def skellam_calibrate(epsilon: float, delta: float, l2: float, l1: float) -> SkellamCalibration:
    """Return the smallest variance ``mu`` meeting both targets.

    ``epsilon(mu) <= epsilon`` at ``delta`` (:func:`skellam_epsilon`), found on the variance
    grid of :func:`dpfed.common.privacy.lattice_gdp.skellam_grid_point` (the grid point itself
    is the smallest variance with its unit), and ``skellam_rho(mu) <= round_rho(epsilon,
    delta)``, the rho of the analytic Gaussian calibrated to the same pair (module docstring),
    to 1e-10 relative. Both decrease in ``mu``: the answer is the larger of the two.
    """
    eps = check_positive(epsilon, "epsilon")
    dl = check_delta(delta)
    l2, l1 = _check_sensitivities(l2, l1)
    rho_cap = round_rho(eps, dl)
    mu = max(_smallest_grid_variance(eps, dl, l2, l1),
             _smallest_variance(lambda m: skellam_rho(m, l2, l1) <= rho_cap, l2,
                                f"rho={rho_cap:g}"))
    return SkellamCalibration(mu, eps, dl, l2, l1, skellam_epsilon(mu, dl, l2, l1))


def _smallest_grid_variance(epsilon: float, delta: float, l2: float, l1: float) -> float:
    """Smallest grid variance whose dominating pair is (epsilon, delta)-DP."""
    def meets(k: int) -> bool:
        return skellam_epsilon(2.0 ** (k / GRID_PER_OCTAVE), delta, l2, l1) <= epsilon

    # A Gaussian with sigma = l2 / mu_G is the floor (the unit is >= 1/sqrt(mu)); the unit at
    # that variance predicts the answer, usually exactly.
    sigma2 = gaussian_sigma(epsilon, delta, l2) ** 2
    floor_k = math.floor(math.log2(sigma2) * GRID_PER_OCTAVE) - 1
    c = skellam_gaussian_mu(2.0 ** (floor_k / GRID_PER_OCTAVE), l2) / l2 * math.sqrt(
        2.0 ** (floor_k / GRID_PER_OCTAVE))
    guess = max(floor_k + 1, math.ceil(math.log2(sigma2 * c * c) * GRID_PER_OCTAVE))
    if meets(guess):
        if not meets(guess - 1):
            return float(2.0 ** (guess / GRID_PER_OCTAVE))
        lo, hi = floor_k, guess - 1
    else:
        lo, step = guess, 4
        hi = lo + step
        while not meets(hi):
            lo, step = hi, step * 2
            hi = lo + step
            if hi > 4096 * GRID_PER_OCTAVE:
                raise ValidationError(f"no Skellam variance reaches epsilon={epsilon:g} at "
                                      f"delta={delta:g}")
    while hi - lo > 1:  # meets(hi), not meets(lo)
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return float(2.0 ** (hi / GRID_PER_OCTAVE))


def _smallest_variance(meets: Callable[[float], bool], l2: float, target: str) -> float:
    """Return the smallest ``mu`` (1e-10 relative, from above) with ``meets(mu)`` (monotone)."""
    lo = l2 * l2 * 1e-6
    hi = max(l2 * l2, 1.0)
    while not meets(hi):
        hi *= 2.0
        if hi > 1e300:
            raise ValidationError(f"no Skellam variance reaches {target}")
    while meets(lo) and lo > 1e-300:
        lo /= 2.0
    for _ in range(200):  # bisection in log space
        mid = math.sqrt(lo * hi)
        if meets(mid):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-10:
            break
    return hi


def skellam_share(mu_total: float, n_parties: int, tolerated: int) -> float:
    """Variance one site adds so that any ``n_parties - tolerated`` honest sites reach ``mu_total``.

    A site that tolerates ``tolerated`` colluding parties (the coordinator counted among them)
    assumes that many of the other shares may be known to an adversary and subtracted; the
    honest shares alone must still sum to ``mu_total``.
    """
    mu = check_positive(mu_total, "mu_total")
    n = check_int(n_parties, "n_parties", minimum=1)
    t = check_int(tolerated, "tolerated", minimum=0)
    if t >= n:
        raise ValidationError(f"tolerating {t} colluding parties needs more than {t} "
                              f"participating sites, got {n}")
    return mu / (n - t)


def skellam_noise(shape: int | tuple[int, ...], mu: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Draw int64 ``Sk(mu)`` noise (difference of two Poisson(mu/2)) of the given shape."""
    m = check_positive(mu, "mu")
    if m / 2 > 2.0 ** 52:  # beyond it float64 (numpy's large-mean sampler) skips integers
        raise ValidationError(f"Skellam variance {m:g} is too large to sample accurately")
    a = rng.poisson(m / 2, size=shape).astype(np.int64)
    b = rng.poisson(m / 2, size=shape).astype(np.int64)
    return a - b
