"""Distributed discrete Laplace from Pólya shares: pure epsilon-DP noise for secure sums.

A Pólya variable ``Pólya(r, alpha)`` (numpy's negative binomial with ``n = r``, ``p = 1 -
alpha``) is infinitely divisible: independent ``Pólya(r_i, alpha)`` sum to ``Pólya(sum r_i,
alpha)``, and ``Pólya(1, alpha) - Pólya'(1, alpha)`` is the discrete Laplace ``DLap(alpha)``,
``P(k) ∝ alpha^|k|``. Each of ``n`` participants adds ``Pólya(r) - Pólya'(r)`` with ``r = 1 /
(n - t - d)`` to every integer coordinate, so any ``n - t - d`` honest survivors carry at least
``DLap(alpha)`` plus independent noise (docs/secure-aggregation.md, "Distributed discrete
Laplace"). Privacy: replace-one, integer L1 sensitivity ``Δ1``; ``alpha = exp(-epsilon / Δ1)``
makes the pooled release pure epsilon-DP (delta 0). Sampling uses numpy's gamma-Poisson
negative binomial from the per-release generator: floating-point grade, like
:mod:`dpfed.common.privacy.skellam`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.validation import check_int, check_positive

__all__ = [
    "DLaplaceCalibration",
    "POLYA_MEAN_MAX",
    "dlaplace_alpha",
    "dlaplace_calibrate",
    "dlaplace_variance",
    "polya_noise",
    "polya_shape",
    "polya_tail",
]

#: Largest mean of one Pólya draw: numpy draws a Poisson of a Gamma's value, exact in float64
#: only well below 2^52 (the Skellam sampler's limit, with room for the Gamma's tail).
POLYA_MEAN_MAX = 2.0 ** 44


def dlaplace_alpha(epsilon: float, l1: float) -> float:
    """Return ``alpha = exp(-epsilon / Δ1)``: ``DLap(alpha)`` on an integer query is epsilon-DP."""
    return math.exp(-check_positive(epsilon, "epsilon") / check_positive(l1, "l1_sensitivity"))


def dlaplace_variance(alpha: float) -> float:
    """Return the variance ``2 alpha / (1 - alpha)^2`` of ``DLap(alpha)``."""
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValidationError(f"alpha must be in (0, 1), got {alpha!r}")
    return 2.0 * a / (1.0 - a) ** 2


def polya_shape(n_parties: int, tolerated: int, dropouts: int = 0) -> float:
    """Return each share's shape ``r = 1 / (n - t - d)``: the honest survivors sum to ``>= 1``."""
    n = check_int(n_parties, "n_parties", minimum=1)
    t = check_int(tolerated, "tolerated", minimum=0)
    d = check_int(dropouts, "dropouts", minimum=0)
    if n - t - d < 1:
        raise ValidationError(f"{n} participants tolerating {t} colluders and {d} dropouts "
                              "leave no honest survivor to carry the noise")
    return 1.0 / (n - t - d)


@dataclass(frozen=True)
class DLaplaceCalibration:
    """The discrete Laplace one secure release must carry to be ``epsilon``-DP.

    Attributes
    ----------
    epsilon : float
        The target, met exactly (``achieved_epsilon``); ``delta`` is 0.
    l2_sensitivity, l1_sensitivity : float
        Sensitivities in the integer domain (only ``Δ1`` calibrates; ``Δ2`` is reported).
    alpha : float
        ``exp(-epsilon / Δ1)``.
    mu : float
        Variance of ``DLap(alpha)`` per coordinate: what the honest survivors carry at least.
    """

    epsilon: float
    l2_sensitivity: float
    l1_sensitivity: float
    alpha: float
    mu: float
    delta: float = 0.0

    @property
    def achieved_epsilon(self) -> float:
        """The epsilon of the pooled release: ``Δ1 ln(1/alpha)``, the target itself."""
        return self.epsilon

    def cost(self) -> PrivacyCost:
        """Return the pooled release's cost: pure epsilon (rho = epsilon^2 / 2)."""
        return PrivacyCost.pure(self.epsilon, mechanism="dlaplace",
                                sensitivity=self.l1_sensitivity, noise_scale=math.sqrt(self.mu))


def dlaplace_calibrate(epsilon: float, l2: float, l1: float) -> DLaplaceCalibration:
    """Return the calibration of ``DLap(exp(-epsilon / Δ1))`` for these integer sensitivities."""
    eps = check_positive(epsilon, "epsilon")
    l2 = check_positive(l2, "l2_sensitivity")
    l1 = check_positive(l1, "l1_sensitivity")
    if l1 < l2 * (1 - 1e-12):
        raise ValidationError(f"l1_sensitivity ({l1:g}) cannot be smaller than "
                              f"l2_sensitivity ({l2:g})")
    alpha = dlaplace_alpha(eps, l1)
    if not 0.0 < alpha < 1.0:
        raise ValidationError(f"epsilon {eps:g} at L1 sensitivity {l1:g} gives no usable "
                              "discrete Laplace (alpha rounds to 0 or 1)")
    return DLaplaceCalibration(eps, l2, l1, alpha, dlaplace_variance(alpha))


def polya_noise(shape: int | tuple[int, ...], r: float, alpha: float,
                rng: np.random.Generator) -> np.ndarray:
    """Draw int64 ``Pólya(r, alpha) - Pólya'(r, alpha)`` noise (one participant's share)."""
    rr = check_positive(r, "r")
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValidationError(f"alpha must be in (0, 1), got {alpha!r}")
    if rr * a / (1.0 - a) > POLYA_MEAN_MAX:
        raise ValidationError(f"a Pólya share of shape {rr:g} at alpha {a!r} is too large to "
                              "sample accurately")
    x = rng.negative_binomial(rr, 1.0 - a, size=shape).astype(np.int64)
    y = rng.negative_binomial(rr, 1.0 - a, size=shape).astype(np.int64)
    return x - y


def _log_upper_tail(k: float, shape: float, alpha: float) -> float:
    """Chernoff bound on ``log P(Pólya(shape, alpha) >= k)`` for ``k`` above the mean.

    The moment generating function is ``((1 - alpha) / (1 - alpha e^l))^shape``; the optimal
    ``alpha e^l = k / (shape + k)`` gives ``shape log((1 - alpha)(shape + k) / shape)
    + k log(alpha (shape + k) / k)``.
    """
    return (shape * math.log((1.0 - alpha) * (shape + k) / shape)
            + k * math.log(alpha * (shape + k) / k))


def polya_tail(shape: float, alpha: float, n_values: int, failure: float = 2.0 ** -60) -> float:
    """Return T with P(max over n_values of |Pólya(shape) - Pólya'(shape)| > T) <= failure.

    ``shape`` is the pooled shape (``n r`` for ``n`` shares). Both Pólyas are non-negative, so
    ``|X - Y| > T`` needs ``X > T`` or ``Y > T``; each has the Chernoff bound of
    :func:`_log_upper_tail`, and a union bound covers the ``2 n_values`` variables.
    """
    s = check_positive(shape, "shape")
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValidationError(f"alpha must be in (0, 1), got {alpha!r}")
    n = check_int(n_values, "n_values", minimum=1)
    target = math.log(failure / (2 * n))
    mean = s * a / (1.0 - a)
    lo = mean
    hi = max(2.0 * mean, 1.0)
    while _log_upper_tail(hi, s, a) > target:
        lo, hi = hi, hi * 2.0
    for _ in range(200):  # the bound falls monotonically above the mean
        mid = (lo + hi) / 2.0
        if _log_upper_tail(mid, s, a) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi
