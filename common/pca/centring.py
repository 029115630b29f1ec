"""Centred DP-PCA: a DP mean round, then the second moment of the rows around that mean.

Spaces (all public maps, see :mod:`dpfed.common.pca.features`)
    ``u``: every column scaled to [-1, 1] by its declared bounds (one-hots in {0, 1});
    ``||u|| <= B = sqrt(#columns)`` (:func:`dpfed.common.pca.features.max_feature_norm`).

Round ``mean`` (site -> coordinator)
    Each site releases ``sum_i u_i / B + N(0, sigma^2 I)`` (:func:`mean_sum_mechanism`). The
    coordinator adds the sites' releases, divides by the public ``N = sum_s N_s``, multiplies by
    ``B`` and clips each coordinate into [-1, 1] (the box every ``u`` lies in): the DP mean
    ``mu`` in the ``u`` space (:func:`dp_mean`). Pure post-processing.
Round ``pca`` (site -> coordinator)
    Each site decomposes ``(1/N_s) sum_i z_i z_i^T`` with
    ``z_i = clip_c(u_i - mu) / c`` (:func:`centre_rows`): the rows centred at the DP mean, clipped
    to the public radius ``c`` and divided by it, so ``||z_i|| <= 1``. The noise is calibrated by
    :func:`centred_pca_mechanism` (sensitivity ``sqrt(2) / N_s``).

Why this construction: clipping the *centred* rows to a radius ``c`` chosen for centred rows
(by the DP quantile of :mod:`dpfed.common.pca.clipping`, or the user) gives the same sensitivity
as the uncentred release while the rows it bounds are much shorter than the uncentred ones (the
mean no longer counts towards their norm), so for the same noise the signal is larger. The
alternative -- expanding ``G/N - x̄ mu^T - mu x̄^T + mu mu^T`` without clipping -- has rows
``u - mu`` of norm up to ``2 B`` and a sensitivity up to 4 times larger.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.mechanisms import GaussianMechanism, SymmetricGaussianMechanism
from dpfed.common.validation import check_finite_array, check_int

#: L2 sensitivity of a sum of unit-ball rows under replace-one (x vs -x).
SUM_SENSITIVITY = 2.0
#: L2 sensitivity of the upper triangle of ``sum z z^T`` for unit-ball z, under replace-one.
GRAM_SENSITIVITY = math.sqrt(2.0)


def mean_sum_mechanism(epsilon: float, delta: float,
                       calibration: str = "analytic") -> GaussianMechanism:
    """Return the mechanism for a site's sum of rows ``sum_i u_i / B`` (the ``mean`` round).

    Privacy
    -------
    Neighbouring relation: replace-one (same ``N_s``, one row differs). Bounds: every row
    ``u_i / B`` lies in the unit L2 ball (``u`` in [-1, 1]^p by the schema's public bounds, B the
    largest norm that allows). Sensitivity: replacing ``x`` by ``y`` changes the sum by
    ``x - y``, ``||x - y||_2 <= 2`` (attained by ``x = -y`` on the sphere). Calibration:
    Gaussian with L2 sensitivity 2 (:func:`dpfed.common.privacy.mechanisms.gaussian_sigma`).
    """
    return GaussianMechanism(epsilon, delta, SUM_SENSITIVITY, calibration)


def dp_mean(noisy_sums: Sequence[np.ndarray], n_total: int, bound: float) -> np.ndarray:
    """Coordinator step of the ``mean`` round: the DP mean ``mu`` in the ``u`` space.

    ``mu = B * sum_s noisy_sum_s / N`` with ``N = sum_s N_s`` public, clipped into the box
    [-1, 1]^p and then, if longer than ``B``, scaled onto the ball of radius ``B``. The true
    mean lies in both (it is an average of rows that do), so the projection is post-processing
    that only moves ``mu`` towards it, and later rounds may rely on ``||u - mu|| <= 2B``.
    """
    if not noisy_sums:
        raise ValidationError("dp_mean needs at least one site's sum")
    n = check_int(n_total, "n_total", minimum=1)
    total = np.sum([check_finite_array(s, "sum", ndim=1) for s in noisy_sums], axis=0)
    mu = np.clip(total * (bound / n), -1.0, 1.0)
    norm = float(np.linalg.norm(mu))
    if norm > bound:
        mu *= bound / norm
    return np.asarray(mu)


def centred_pca_mechanism(n_rows: int, epsilon: float, delta: float,
                          calibration: str = "analytic") -> SymmetricGaussianMechanism:
    """Return the mechanism that noises ``(1/N_s) sum_i z_i z_i^T`` for centred rows ``z``.

    Privacy
    -------
    Neighbouring relation: replace-one (``N_s`` public, one row ``x`` replaced by ``y``).
    Bounds: ``z = clip_c(u - mu) / c`` with ``mu`` public (the DP mean of the earlier round, any
    value) and ``c`` public (the DP quantile of an earlier round or the user's), so
    ``||z||_2 <= 1`` for every row whatever ``u`` and ``mu`` are. Sensitivity: the statistic
    changes by ``D = (z_x z_x^T - z_y z_y^T) / N_s``. With ``a = z_x``, ``b = z_y``:
    ``||a a^T - b b^T||_F^2 = ||a||^4 + ||b||^4 - 2 (a.b)^2 <= 1 + 1 - 0 = 2``, and the upper
    triangle with diagonal is a subset of the entries, so its L2 norm is at most
    ``sqrt(2) / N_s``. The bound is attained (``a = e1``, ``b = e2``: diagonal entries +1 and -1).
    Calibration: symmetric Gaussian noise on the upper triangle with L2 sensitivity
    ``sqrt(2) / N_s``, analytic (Balle & Wang 2018) by default.
    """
    n = check_int(n_rows, "n_rows", minimum=1)
    return SymmetricGaussianMechanism(epsilon, delta, GRAM_SENSITIVITY / n, calibration)


def centre_rows(u: np.ndarray, center: np.ndarray, unit_ball: UnitBallMap
                ) -> tuple[np.ndarray, int]:
    """Return ``(clip_c(u - center) / c, n_clipped)`` in place, ``c = unit_ball.norm``."""
    u -= center[None, :]
    return unit_ball.clip_rows(u)


def check_center(center: np.ndarray | None, n_features: int, bound: float) -> np.ndarray:
    """Validate a centre received over the network: finite, shape (p,), in [-1, 1]^p, norm <= B."""
    if center is None:
        raise ValidationError("a centred pca task needs the array 'center'")
    c = check_finite_array(center, "center", ndim=1)
    if c.shape != (n_features,):
        raise ValidationError(f"center must have shape ({n_features},), got {c.shape}")
    if np.any(np.abs(c) > 1.0):
        raise ValidationError("center must lie in [-1, 1] (the scaled feature box)")
    if float(np.linalg.norm(c)) > bound * (1 + 1e-9):
        raise ValidationError(f"center must have norm <= {bound:g} (the largest row norm)")
    return np.asarray(c, dtype=np.float64)
