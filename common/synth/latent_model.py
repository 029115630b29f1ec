"""The latent second-moment model shared by every synthesis step (post-processing only).

The functions the factor model is built from, used by the central synthesizer
(:mod:`dpfed.common.synth.factor_model`), the fitted generative model
(:mod:`dpfed.common.synth.generative`) and the correlation correction
(:mod:`dpfed.common.synth.correlation`): the rank rule on a noisy spectrum, the PPCA residual,
the DP second moment rebuilt from a DP-PCA estimate, the per-coordinate rescaling, and the
nearest-correlation projection. They live below those modules so that each can use them
without importing the others. Every function here is post-processing of DP releases.
"""

from __future__ import annotations

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.pca.dppca import PCAEstimate
from dpfed.common.synth.links import LatentLinks
from dpfed.common.validation import (
    check_finite_array,
    check_int,
    check_nonnegative,
    check_positive,
    check_probability,
)

_ORTHONORMAL_TOL = 1e-8


def choose_rank(eigenvalues: np.ndarray, threshold: float = 0.8, *, total: float | None = None,
                max_rank: int | None = None) -> int:
    """Cumulative-information rule ``r(c) = min{k : sum_{j<=k} nu_j / sum_j nu_j > c}``.

    Coordinator step on the *noisy* eigenvalues (post-processing of DP-PCA).

    Parameters
    ----------
    eigenvalues : ndarray
        Eigenvalues (sorted descending here; negative noisy values count as 0).
    threshold : float
        ``c`` in (0, 1); the seed suggests 0.8 or 0.9.
    total : float, optional
        The denominator ``sum_j nu_j`` when ``eigenvalues`` holds only the top few (e.g.
        ``PCAEstimate.total_variance``); default their sum.
    max_rank : int, optional
        Cap on the result.

    Returns
    -------
    int
        ``r >= 1``; ``len(eigenvalues)`` (or ``max_rank``) if no prefix exceeds ``c``.
    """
    c = check_probability(threshold, "threshold")
    nu = check_finite_array(eigenvalues, "eigenvalues", ndim=1)
    if nu.size == 0:
        raise ValidationError("eigenvalues must not be empty")
    nu = np.sort(np.clip(nu, 0.0, None))[::-1]
    cap = nu.size if max_rank is None else min(nu.size, check_int(max_rank, "max_rank",
                                                                  minimum=1))
    denominator = float(nu.sum()) if total is None else check_nonnegative(total, "total")
    if denominator <= 0.0:
        return 1
    ratio = np.cumsum(nu) / denominator
    above = np.flatnonzero(ratio > c)
    r = int(above[0]) + 1 if above.size else nu.size
    return min(r, cap)


def residual_variance(estimate: PCAEstimate, rank: int, n_features: int) -> float:
    """Per-dimension variance left outside the top ``rank`` components (PPCA's sigma^2).

    ``(total_variance - sum_{k<=r} lambda_k) / (p - r)``, floored at 0; 0 when ``r = p``.
    Post-processing of the DP-PCA release.
    """
    r = check_int(rank, "rank", minimum=1, maximum=n_features)
    if r >= n_features:
        return 0.0
    left = estimate.total_variance - float(np.sum(estimate.eigenvalues[:r]))
    return max(left, 0.0) / (n_features - r)


def _check_loadings(loadings: np.ndarray, n_features: int | None = None) -> np.ndarray:
    v = check_finite_array(loadings, "loadings", ndim=2)
    p, r = v.shape
    if r < 1 or r > p:
        raise ValidationError(f"loadings must be p x r with 1 <= r <= p, got {v.shape}")
    if n_features is not None and p != n_features:
        raise ValidationError(f"loadings have {p} rows, the latent rows have {n_features}")
    gram = v.T @ v
    if float(np.abs(gram - np.eye(r)).max()) > _ORTHONORMAL_TOL:
        raise ValidationError(
            "loadings must have orthonormal columns (V^T V = I); use orthonormalize()")
    return v


def check_factor_inputs(loadings: np.ndarray, eigenvalues: np.ndarray, dim: int,
                        clip_norm: float, residual: float
                        ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Validate a factor model's DP quantities: ``(V, lambda >= 0, clip norm, residual)``."""
    v = _check_loadings(loadings, dim)
    lam = np.clip(check_finite_array(eigenvalues, "eigenvalues", ndim=1), 0.0, None)
    if lam.shape[0] != v.shape[1]:
        raise ValidationError(f"need {v.shape[1]} eigenvalues, got {lam.shape[0]}")
    return (v, lam, check_positive(clip_norm, "clip_norm"),
            check_nonnegative(residual, "residual"))


def latent_rescaling(links: LatentLinks, loadings: np.ndarray, eigenvalues: np.ndarray, *,
                     clip_norm: float, residual: float = 0.0,
                     factor_noise_variance: float = 0.0,
                     include_residual: bool = True) -> np.ndarray:
    """Per latent coordinate, the factor that gives it its modelled variance (post-processing).

    In unit-ball units the synthetic latent of coordinate j has variance
    ``s_j = sum_k (lambda_k + noise) V_jk^2 + res (1 - sum_k V_jk^2)`` (``res`` = the
    residual variance in generative mode, 0 in row-aligned mode, ``noise`` the factor
    noise variance ``2 b^2`` in row-aligned mode). Its target is ``1 / C^2`` where the link
    model makes the coordinate N(0, 1) (ordinal, nominal, DP-standardised continuous), else
    the DP second moment ``sum_k lambda_k V_jk^2 + residual (1 - sum_k V_jk^2)``. Returns
    ``sqrt(target / s_j)`` (1 where ``s_j`` is 0). Uses only DP quantities.
    """
    v, lam, c, res = check_factor_inputs(loadings, eigenvalues, links.dim, clip_norm, residual)
    noise = check_nonnegative(factor_noise_variance, "factor_noise_variance")
    v2 = v * v
    outside = np.clip(1.0 - v2.sum(axis=1), 0.0, None)
    second_moment = v2 @ lam + res * outside
    modelled = v2 @ (lam + noise) + (res * outside if include_residual else 0.0)
    target = np.where(links.standard_normal, 1.0 / (c * c), second_moment)
    scale = np.ones(links.dim)
    ok = modelled > 0
    scale[ok] = np.sqrt(target[ok] / modelled[ok])
    return scale


def dp_second_moment(estimate: PCAEstimate, n_features: int) -> np.ndarray:
    """Rebuild the DP second-moment matrix (unit-ball units) from a DP-PCA estimate.

    ``V diag(lambda) V^T`` over the released components, plus the residual energy
    ``(total - sum lambda) / (p - K)`` spread over the complement of their span (nothing when
    all p components were released). Post-processing.
    """
    p = check_int(n_features, "n_features", minimum=1)
    v = check_finite_array(estimate.components, "components", ndim=2).T  # p x K
    if v.shape[0] != p:
        raise ValidationError(f"components have {v.shape[0]} columns, expected {p}")
    lam = np.clip(np.asarray(estimate.eigenvalues, dtype=np.float64), 0.0, None)
    moment = (v * lam[None, :]) @ v.T
    k = v.shape[1]
    if k < p:
        rest = max(estimate.total_variance - float(lam.sum()), 0.0) / (p - k)
        moment += rest * (np.eye(p) - v @ v.T)
    return np.asarray(0.5 * (moment + moment.T))


def _nearest_correlation(matrix: np.ndarray, fixed: np.ndarray | None = None,
                         floor: float = 1e-6, iterations: int = 100) -> np.ndarray:
    """Nearest PSD matrix with unit diagonal and zeros where ``fixed`` (Higham 2002).

    Alternating projections with Dykstra's correction between the PSD cone (eigenvalues
    clipped at ``floor``) and the affine set {unit diagonal, 0 on ``fixed`` off-diagonal
    entries}; a final eigenvalue clip and rescale guarantee a PSD unit-diagonal result.
    """
    p = matrix.shape[0]
    pinned = np.eye(p, dtype=bool) if fixed is None else (fixed | np.eye(p, dtype=bool))
    pinned_values = np.eye(p)
    y = 0.5 * (matrix + matrix.T)
    correction = np.zeros_like(y)
    for _ in range(iterations):
        r = y - correction
        values, vectors = np.linalg.eigh(r)
        x = (vectors * np.clip(values, floor, None)[None, :]) @ vectors.T
        correction = x - r
        y = np.where(pinned, pinned_values, x)
        if float(np.abs(y - x).max()) < 1e-9:
            break
    values, vectors = np.linalg.eigh(0.5 * (y + y.T))
    psd = (vectors * np.clip(values, floor, None)[None, :]) @ vectors.T
    d = np.sqrt(np.diag(psd))
    return np.asarray(psd / d[:, None] / d[None, :])


def _correlation_of(moment: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.clip(np.diag(moment), 1e-300, None))
    return np.asarray(moment / d[:, None] / d[None, :])
