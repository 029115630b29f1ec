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

Round order with a clip radius (``clip_norm="auto"`` or a number; the library for it is here,
the job wiring comes later)
    ``norms`` first, on the *uncentred* rows: the DP quantile ``c`` of ``||u||``
    (:mod:`dpfed.common.pca.clipping`); then ``mean`` of the rows clipped to ``c``
    (:func:`clipped_mean_sum_mechanism`, sensitivity ``2c`` instead of ``2B``:
    :func:`clipped_mean`); then ``pca`` on ``z = clip_c(u - mu) / c``. On wide data the box
    bound ``B = sqrt(p)`` is far above the rows' norms (14.1 against about 1 at p = 200), and a
    mean noised at ``B`` is mostly noise (norm 2.2 against a true 0.011 in the DPdisPCA set-up),
    which clipping at ``c`` then erases from every row. :func:`centred_round_split` divides the
    budget between the three rounds from public quantities; ``bench/pca_centring.py`` measures
    both orders.

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
from dpfed.common.privacy.mechanisms import (
    GaussianMechanism,
    SymmetricGaussianMechanism,
    gaussian_sigma,
)
from dpfed.common.validation import check_finite_array, check_int, check_positive

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


def clipped_mean_sum_mechanism(clip_norm: float, epsilon: float, delta: float,
                               calibration: str = "analytic") -> GaussianMechanism:
    """Return the mechanism for a site's sum of rows clipped to a public radius ``c``.

    The site releases ``sum_i clip_c(u_i) + N(0, sigma^2 I)`` (:func:`clip_to_radius`).

    Privacy
    -------
    Neighbouring relation: replace-one (same ``N_s``, one row differs). Bounds: ``c`` is public
    (a DP quantile of an earlier round, or the analyst's number), and every clipped row has
    norm at most ``c`` whatever the data. Sensitivity: replacing ``x`` by ``y`` changes the sum
    by ``clip_c(x) - clip_c(y)``, of norm at most ``2c`` (attained by ``x = -y`` on the sphere
    of radius ``c``). Calibration: Gaussian with L2 sensitivity ``2c``
    (:func:`dpfed.common.privacy.mechanisms.gaussian_sigma`), analytic by default.
    """
    return GaussianMechanism(epsilon, delta, SUM_SENSITIVITY * check_positive(clip_norm,
                                                                             "clip_norm"),
                             calibration)


def clip_to_radius(u: np.ndarray, clip_norm: float) -> tuple[np.ndarray, int]:
    """Return ``(clip_c(u), n_clipped)``: rows longer than ``c`` scaled onto its sphere (a copy)."""
    c = check_positive(clip_norm, "clip_norm")
    x = np.array(u, dtype=np.float64, copy=True)
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    over = norms > c
    x[over] *= (c / norms[over])[:, None]
    return x, int(np.count_nonzero(over))


def clipped_mean(noisy_sums: Sequence[np.ndarray], n_total: int, clip_norm: float) -> np.ndarray:
    """Coordinator step of the clipped ``mean`` round: ``mu = sum_s noisy_sum_s / N``.

    ``N = sum_s N_s`` is public. The mean of rows clipped to ``c`` lies in the ball of radius
    ``c``, so ``mu`` is projected onto it: post-processing that only moves it towards the
    truth (and keeps ``||u - mu||`` bounded by ``||u|| + c``).
    """
    if not noisy_sums:
        raise ValidationError("clipped_mean needs at least one site's sum")
    n = check_int(n_total, "n_total", minimum=1)
    c = check_positive(clip_norm, "clip_norm")
    mu = np.sum([check_finite_array(s, "sum", ndim=1) for s in noisy_sums], axis=0) / n
    norm = float(np.linalg.norm(mu))
    if norm > c:
        mu *= c / norm
    return np.asarray(mu)


#: The DP quantile's cumulative count may be off by this fraction of N (3 standard deviations).
QUANTILE_COUNT_ERROR = 0.1
#: The mean's error energy ``||e||^2`` against the PCA noise's spectral norm.
MEAN_ERROR_RATIO = 0.1
#: Bounds of the norms and mean rounds' shares of mu^2.
_SHARE_RANGE = (0.005, 0.25)


def centred_round_split(n_features: int, n_total: int, epsilon: float, delta: float, *,
                        n_sites: int = 10, n_bins: int = 41,
                        rounds: Sequence[str] = ("norms", "mean", "pca"),
                        pooled_noise: float | None = None
                        ) -> list[tuple[str, float, float]]:
    """Return the shares of ``mu^2`` for ``rounds`` (of norms, mean, pca), from public numbers.

    ``mu`` is the GDP parameter of the job's (epsilon, delta)
    (:func:`dpfed.common.privacy.composition.gdp_split` turns the shares into per-round
    pairs). ``S`` is the pooled sums' noise variance in units of one release calibrated to
    the round: ``n_sites`` independent draws at site level (the default), or a secure sum's
    ``n / (n - t - d)`` (``pooled_noise``,
    :func:`dpfed.common.jobs.modes.secure_pooled_factor`). Each auxiliary round gets what
    its job needs and no more:

    ``norms``
        The pooled histogram of ``n_bins`` bins (sensitivity ``sqrt(2)``) carries ``S``
        times one release's noise; its cumulative count must stay within
        :data:`QUANTILE_COUNT_ERROR` of ``N`` at three standard deviations:
        ``mu_n = 3 sqrt(2 n_bins S) / (QUANTILE_COUNT_ERROR N)``.
    ``mean``
        The mean of rows clipped to ``c`` is off by ``||e||^2 ~ 4 c^2 p S / (mu_m N)^2``; it
        enters the centred second moment as a rank-one term, set to :data:`MEAN_ERROR_RATIO`
        of the PCA noise's spectral norm ``2 sqrt(2 p S) c^2 / (mu_pca N)``:
        ``mu_m^2 = sqrt(2 p S) mu_pca / (MEAN_ERROR_RATIO N)``.
    ``pca``
        The rest.

    Both auxiliary shares are kept within [0.005, 0.25]; delta shares are 0.1 for each
    auxiliary round and the rest for ``pca``. Nothing here reads data: a split is a public
    function of the job's parameters, its connected sites' row counts, their number and
    (secure) their policies' ``t`` and ``d``.
    """
    p = check_int(n_features, "n_features", minimum=1)
    n = check_int(n_total, "n_total", minimum=1)
    sites = (float(check_int(n_sites, "n_sites", minimum=1)) if pooled_noise is None
             else check_positive(pooled_noise, "pooled_noise"))
    bins = check_int(n_bins, "n_bins", minimum=1)
    names = [r for r in ("norms", "mean", "pca") if r in rounds]
    if set(names) != set(rounds) or "pca" not in names:
        raise ValidationError(f"rounds must be some of norms, mean and then pca, got {rounds}")
    mu = 1.0 / gaussian_sigma(epsilon, delta, 1.0)
    lo, hi = _SHARE_RANGE
    share_norms = 0.0
    if "norms" in names:
        mu_norms = 3.0 * math.sqrt(2.0 * bins * sites) / (QUANTILE_COUNT_ERROR * n)
        share_norms = min(max(mu_norms ** 2 / mu ** 2, lo), hi)
    share_mean = lo if "mean" in names else 0.0
    for _ in range(3 if "mean" in names else 0):  # mu_pca depends on the shares
        mu_pca = mu * math.sqrt(1.0 - share_norms - share_mean)
        mu_mean2 = math.sqrt(2.0 * p * sites) * mu_pca / (MEAN_ERROR_RATIO * n)
        share_mean = min(max(mu_mean2 / mu ** 2, lo), hi)
    shares = {"norms": share_norms, "mean": share_mean,
              "pca": 1.0 - share_norms - share_mean}
    aux = len(names) - 1
    return [(r, shares[r], 1.0 - 0.1 * aux if r == "pca" else 0.1) for r in names]


#: The centred radius is never taken below this fraction of the uncentred one.
MIN_CENTRED_RADIUS = 0.25


def centred_radius(clip_norm: float, center: np.ndarray) -> float:
    """Return the clip radius for rows centred at ``center``: ``sqrt(c^2 - ||mu||^2)``.

    ``c`` is the DP quantile of the *uncentred* row norms and ``mu`` the DP mean of the rows
    clipped to it; since ``mean ||u||^2 = ||mean u||^2 + mean ||u - mean u||^2``, the centred
    rows' norms sit about ``||mu||^2`` lower in square (on the demo data: 1.22 against the
    centred rows' true 0.9-quantile 1.15, where ``c`` is 2.32). Kept at least
    :data:`MIN_CENTRED_RADIUS` ``c``. Post-processing of two public DP releases: any radius
    computed from them is public, and the ``pca`` round's sensitivity does not depend on it.
    """
    c = check_positive(clip_norm, "clip_norm")
    m2 = float(np.dot(center, center))
    return max(math.sqrt(max(c * c - m2, 0.0)), MIN_CENTRED_RADIUS * c)


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
