"""Additive-noise mechanisms and their calibration: Laplace, Gaussian, symmetric Gaussian matrix.

Every mechanism here is a frozen dataclass that validates its parameters on construction,
states its noise scale, and carries its own privacy cost (:meth:`cost`), so a site can charge
the ledger *before* it calls :meth:`release`. The random generator is always a parameter.

Gaussian calibration
--------------------
``calibration="analytic"`` (the default) solves the exact condition of Balle & Wang (ICML
2018, Thm. 8) for the smallest sigma:

    delta(sigma) = Phi(D/(2 sigma) - eps sigma/D) - exp(eps) Phi(-D/(2 sigma) - eps sigma/D)

It is tighter than the classic ``sigma = D sqrt(2 ln(1.25/delta)) / eps`` (Dwork & Roth, Thm.
A.1) and valid for every eps > 0. The classic formula is proved only for eps < 1 and
under-noises above that (at eps = 10, delta = 1e-5 its true delta is 2.3e-5). It stays
available as ``calibration="classic"`` to reproduce the DPdisPCA paper, but is accepted only
where it is actually DP: eps < 1, or eps >= 1 when the exact delta(sigma_classic) <= delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.linalg import mirror_upper
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.pld import gaussian_hockey_stick_upper
from dpfed.common.validation import check_choice, check_delta, check_epsilon, check_positive

Calibration = Literal["analytic", "classic"]
CALIBRATIONS: tuple[str, ...] = ("analytic", "classic")


# --------------------------------------------------------------------------- Laplace


def laplace_scale(epsilon: float, sensitivity: float = 1.0) -> float:
    """Return the Laplace scale ``b >= sensitivity / epsilon`` for an epsilon-DP release.

    The quotient of two doubles is rounded to the nearest double, which may lie below the
    exact ratio (and give a release of epsilon one ulp above the target); it is moved up one
    ulp when it does, checked in exact rational arithmetic.

    Parameters
    ----------
    epsilon : float
        Privacy parameter, finite and > 0.
    sensitivity : float
        L1 sensitivity of the released quantity under the neighbouring relation in use.
    """
    eps = check_epsilon(epsilon)
    sens = check_positive(sensitivity, "sensitivity")
    scale = sens / eps
    if Fraction(scale) * Fraction(eps) < Fraction(sens):
        scale = math.nextafter(scale, math.inf)
    return scale


@dataclass(frozen=True)
class LaplaceMechanism:
    """Add iid Laplace noise of scale ``sensitivity / epsilon`` to every entry.

    Privacy
    -------
    Neighbouring relation: whatever relation ``sensitivity`` was derived under (the caller
    states it). Sensitivity: the L1 norm of the largest change of the released vector between
    neighbours. Calibration: ``b = sensitivity / epsilon`` gives pure epsilon-DP (Dwork,
    McSherry, Nissim & Smith 2006), with ``b`` never below the exact ratio
    (:func:`laplace_scale`); as zCDP, rho = epsilon^2 / 2 (Bun & Steinke 2016, Prop. 1.4).
    Floating-point grade: outputs are IEEE doubles, not an exact sampler; see
    ``dpfed.common.privacy.exact_samplers`` for integer releases.
    """

    epsilon: float
    sensitivity: float = 1.0
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
        object.__setattr__(self, "sensitivity", check_positive(self.sensitivity, "sensitivity"))
        object.__setattr__(self, "scale", laplace_scale(self.epsilon, self.sensitivity))

    def cost(self) -> PrivacyCost:
        """Return the privacy cost of one release."""
        return PrivacyCost.pure(self.epsilon, mechanism="laplace",
                                sensitivity=self.sensitivity, noise_scale=self.scale)

    def release(self, value: np.ndarray | float, rng: np.random.Generator) -> np.ndarray:
        """Return ``value`` plus iid Laplace(0, scale) noise of the same shape."""
        v = np.asarray(value, dtype=np.float64)
        return v + rng.laplace(0.0, self.scale, size=v.shape)


# --------------------------------------------------------------------------- Gaussian


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """Return the exact delta of the Gaussian mechanism (Balle & Wang 2018, Thm. 8), from above.

    ``delta(sigma) = Phi(D/(2s) - e s/D) - exp(e) Phi(-D/(2s) - e s/D)``, evaluated in log
    space plus a bound on its floating-point error
    (:func:`dpfed.common.privacy.pld.gaussian_hockey_stick_upper`): the two terms nearly
    cancel at small epsilon, where a plain double evaluation can land below the exact value
    (by 1.7e-10 relative at epsilon 0.0014, delta 3.4e-14). Never below the exact delta.
    """
    s = check_positive(sigma, "sigma")
    eps = check_epsilon(epsilon)
    d = check_positive(sensitivity, "sensitivity")
    return min(float(gaussian_hockey_stick_upper(eps, d / s)), 1.0)


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Return the textbook ``sensitivity * sqrt(2 ln(1.25/delta)) / epsilon``, unchecked.

    This is the formula of the DPdisPCA paper. It is DP only for epsilon < 1 (Dwork & Roth,
    Thm. A.1) or where :func:`gaussian_delta` of the result is <= delta; use
    :func:`gaussian_sigma` with ``calibration="classic"`` to get it only where it is valid.
    Benchmarks that reproduce the paper's invalid points call this directly and label them.
    """
    eps = check_epsilon(epsilon)
    dl = check_delta(delta)
    return check_positive(sensitivity, "sensitivity") * math.sqrt(2.0 * math.log(1.25 / dl)) / eps


def classic_calibration_is_dp(epsilon: float, delta: float) -> bool:
    """Return True where the classic sigma gives (epsilon, delta)-DP.

    It does for epsilon < 1 (the theorem's range), and otherwise exactly when the Balle-Wang
    delta of the classic sigma is <= delta. The check is scale-free (sensitivity cancels).
    """
    eps = check_epsilon(epsilon)
    dl = check_delta(delta)
    if eps < 1.0:
        return True
    return gaussian_delta(classic_gaussian_sigma(eps, dl), eps) <= dl


def _analytic_sigma_unit(epsilon: float, delta: float) -> float:
    """Smallest sigma with gaussian_delta(sigma, epsilon, 1) <= delta (sensitivity 1)."""

    def gap(log_sigma: float) -> float:
        # Relative gap in log space: smooth and well scaled over many decades of delta.
        return math.log(max(gaussian_delta(math.exp(log_sigma), epsilon), 1e-300)) - math.log(delta)

    lo, hi = math.log(1e-6), math.log(10.0)
    while gap(lo) < 0:  # delta(lo) already below target: sigma is smaller still
        lo -= 5.0
    while gap(hi) > 0:
        hi += 5.0
    from scipy import optimize  # here: a module-level import costs every start-up
    root = optimize.brentq(gap, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    sigma = math.exp(root)
    # delta (from above) is decreasing in sigma: step up until the condition holds.
    step = math.ulp(sigma)
    while gaussian_delta(sigma, epsilon) > delta:
        sigma += step
        step *= 2.0
    return sigma


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0,
                   calibration: str = "analytic") -> float:
    """Return the Gaussian noise standard deviation for an (epsilon, delta)-DP release.

    Parameters
    ----------
    epsilon : float
        Finite, > 0.
    delta : float
        In (0, 1).
    sensitivity : float
        L2 sensitivity of the released vector under the caller's neighbouring relation.
    calibration : {"analytic", "classic"}
        ``"analytic"`` solves Balle & Wang's exact condition (tightest sigma, any epsilon).
        ``"classic"`` uses ``sensitivity * sqrt(2 ln(1.25/delta)) / epsilon`` and is refused
        where it is not DP (see :func:`classic_calibration_is_dp`).

    Raises
    ------
    ValidationError
        For invalid parameters, or classic calibration outside its valid range.

    Privacy
    -------
    The returned sigma makes ``x + N(0, sigma^2 I)`` (epsilon, delta)-DP for any x with
    L2 sensitivity ``sensitivity``: analytic by Balle & Wang (2018) Thm. 8; classic by Dwork &
    Roth (2014) Thm. A.1 for epsilon < 1, and by the same exact condition otherwise.
    """
    eps = check_epsilon(epsilon)
    dl = check_delta(delta)
    d = check_positive(sensitivity, "sensitivity")
    check_choice(calibration, "calibration", CALIBRATIONS)
    if calibration == "classic":
        if not classic_calibration_is_dp(eps, dl):
            true_delta = gaussian_delta(classic_gaussian_sigma(eps, dl), eps)
            raise ValidationError(
                f"calibration='classic' is not differentially private at epsilon={eps:g}, "
                f"delta={dl:g} (its sigma gives a true delta of {true_delta:.3g}); "
                "use calibration='analytic', or epsilon < 1"
            )
        return classic_gaussian_sigma(eps, dl, d)
    return d * _analytic_sigma_unit(eps, dl)


@dataclass(frozen=True)
class GaussianMechanism:
    """Add iid N(0, sigma^2) noise, sigma calibrated for (epsilon, delta)-DP.

    Privacy
    -------
    Neighbouring relation: the caller's (stated where ``sensitivity`` is derived).
    Sensitivity: L2 norm of the largest change of the released vector between neighbours.
    Calibration: :func:`gaussian_sigma` (analytic Balle & Wang by default). As zCDP the same
    release is rho = sensitivity^2 / (2 sigma^2) (Bun & Steinke 2016, Prop. 1.6), which is
    what the zCDP accountant charges. Floating-point grade (IEEE doubles).
    """

    epsilon: float
    delta: float
    sensitivity: float = 1.0
    calibration: str = "analytic"
    sigma: float = field(init=False)

    def __post_init__(self) -> None:
        sigma = gaussian_sigma(self.epsilon, self.delta, self.sensitivity, self.calibration)
        object.__setattr__(self, "epsilon", float(self.epsilon))
        object.__setattr__(self, "delta", float(self.delta))
        object.__setattr__(self, "sensitivity", float(self.sensitivity))
        object.__setattr__(self, "sigma", sigma)

    def cost(self) -> PrivacyCost:
        """Return the privacy cost of one release."""
        return PrivacyCost.gaussian(self.epsilon, self.delta, sigma=self.sigma,
                                    sensitivity=self.sensitivity)

    def release(self, value: np.ndarray | float, rng: np.random.Generator) -> np.ndarray:
        """Return ``value`` plus iid N(0, sigma^2) noise of the same shape."""
        v = np.asarray(value, dtype=np.float64)
        return v + self.sigma * rng.standard_normal(size=v.shape)


def symmetric_gaussian_noise(p: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Return a symmetric p x p matrix whose upper triangle (with diagonal) is iid N(0, sigma^2).

    The lower triangle mirrors the upper one, as in DPdisPCA (Imtiaz & Sarwate 2018) and its
    reference code (``my_AG``). Adding this to a symmetric statistic is the Gaussian mechanism
    on the vector of its p(p+1)/2 upper-triangular entries.
    """
    if p <= 0:
        raise ValidationError(f"p must be a positive integer, got {p}")
    check_positive(sigma, "sigma")
    noise = rng.standard_normal(size=(p, p))
    # Mirror the strict upper triangle into the lower one in place: one p x p matrix in
    # memory, the same values as np.triu(noise) + np.triu(noise, 1).T.
    mirror_upper(noise)
    noise *= sigma
    return noise


@dataclass(frozen=True)
class SymmetricGaussianMechanism:
    """Release a symmetric matrix ``A + E`` with E symmetric, upper triangle iid N(0, sigma^2).

    Privacy
    -------
    Neighbouring relation and sensitivity are the caller's: ``sensitivity`` must bound the L2
    norm of the change in the *upper triangle including the diagonal* of A. For
    ``A = (1/N) sum_i x_i x_i^T`` with ||x_i||_2 <= 1 under dpfed's relation, replace-one with
    N public (docs/privacy.md), that is ``||upper(x x^T - y y^T)||_2 / N <= ||x x^T - y y^T||_F
    / N <= sqrt(2)/N`` (attained by x = e1, y = e2). Calibration: :func:`gaussian_sigma` on
    that vector.
    """

    epsilon: float
    delta: float
    sensitivity: float
    calibration: str = "analytic"
    sigma: float = field(init=False)

    def __post_init__(self) -> None:
        sigma = gaussian_sigma(self.epsilon, self.delta, self.sensitivity, self.calibration)
        object.__setattr__(self, "sigma", sigma)

    def cost(self) -> PrivacyCost:
        """Return the privacy cost of one release."""
        return PrivacyCost.gaussian(float(self.epsilon), float(self.delta), sigma=self.sigma,
                                    sensitivity=float(self.sensitivity),
                                    mechanism="symmetric-gaussian")

    def release(self, matrix: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Return ``matrix + E`` (a new array; ``matrix`` must be square and symmetric)."""
        a = np.asarray(matrix, dtype=np.float64)
        if a.ndim != 2 or a.shape[0] != a.shape[1]:
            raise ValidationError(f"matrix must be square, got shape {a.shape}")
        out = symmetric_gaussian_noise(a.shape[0], self.sigma, rng)
        out += a
        return out
