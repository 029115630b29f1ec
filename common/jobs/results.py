"""Checks of a site's release against what an honest site could have sent.

A round's ``check`` combines these; each raises :class:`ProtocolError` naming the array and
the bound, so the site's outcome becomes "error" with that reason and its release is left out
of the job. The wire codec already rejects NaN and infinite array entries; these checks add
the finite-but-impossible ones (an entry of 1e308 that overflows the combination, a factor
1000 times larger than any honest release), which would otherwise poison the result or
silently dominate it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpfed.common.errors import ProtocolError
from dpfed.common.transport.protocol import TaskResult

#: Room for a result's envelope (task id, metadata, spend, array headers) beyond its arrays.
RESULT_ENVELOPE_BYTES = 64 << 10
#: Tail parameter t of the noise bound: P(||E||_2 > sigma (2 sqrt(p) + t)) <= exp(-t^2 / 4),
#: about 2e-16 per release for t = 12, so an honest site is (practically) never rejected.
NOISE_BOUND_TAIL = 12.0


def symmetric_gaussian_norm_bound(sigma: float, p: int, t: float = NOISE_BOUND_TAIL) -> float:
    """High-probability bound on the spectral norm of a p x p symmetric Gaussian noise matrix.

    E is symmetric with its upper triangle (diagonal included) iid N(0, sigma^2), as drawn by
    ``dpfed.common.privacy.mechanisms.symmetric_gaussian_noise``. Then E||E||_2 <= 2 sigma
    sqrt(p) (the semicircle edge; Bandeira & van Handel 2016 for the non-asymptotic form),
    and ||E||_2 is sqrt(2) sigma-Lipschitz in the standardised upper-triangle entries
    (||E||_2 <= ||E||_F <= sqrt(2) ||upper||_2), so by Gaussian concentration
    P(||E||_2 > sigma (2 sqrt(p) + t)) <= exp(-t^2 / 4).

    Parameters
    ----------
    sigma : float
        Per-entry noise standard deviation (public: it follows from epsilon, delta, the
        calibration and the site's public N_s).
    p : int
        Matrix dimension.
    t : float
        Tail parameter (default :data:`NOISE_BOUND_TAIL`).
    """
    if not (math.isfinite(sigma) and sigma >= 0 and p >= 1 and t >= 0):
        raise ValueError(f"invalid noise bound arguments sigma={sigma!r}, p={p!r}, t={t!r}")
    return sigma * (2.0 * math.sqrt(p) + t)


def vector_bound(n_rows: int, sigma: float, length: int, t: float = NOISE_BOUND_TAIL) -> float:
    """Bound on the norm of an honest noisy sum of ``n_rows`` vectors of norm at most 1.

    The exact part has norm at most ``n_rows``; Gaussian noise of ``length`` entries with
    standard deviation ``sigma`` has norm at most ``sigma (sqrt(length) + t)`` but with
    probability ``exp(-t^2 / 2)`` (Gaussian concentration of a 1-Lipschitz function).
    """
    return n_rows + sigma * (math.sqrt(length) + t)


def require_array(result: TaskResult, name: str, shape: tuple[int, ...],
                  dtype: type[np.floating[Any]] = np.float64) -> np.ndarray:
    """Return ``result.arrays[name]`` if it has this shape and dtype and is all finite."""
    a = result.arrays.get(name)
    if a is None or a.shape != shape or a.dtype != dtype:
        got = None if a is None else f"{a.dtype} {a.shape}"
        raise ProtocolError(f"expected a {np.dtype(dtype)} array {name!r} of shape {shape}, "
                            f"got {got}")
    if not np.all(np.isfinite(a)):
        raise ProtocolError(f"array {name!r} contains NaN or infinite values")
    return a


def require_positive_int(metadata: Mapping[str, Any], key: str) -> int:
    """Return ``metadata[key]`` if it is a positive integer."""
    n = metadata.get(key)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ProtocolError(f"result lacks a positive integer {key!r}")
    return n


def check_gram_factor(factor: np.ndarray, name: str, *, trace_bound: float,
                      noise_norm_bound: float) -> None:
    """Check a factor P (p x R) of a noisy Gram release ``P P^T ~ top-R part of A + E``.

    An honest site computes ``A + E`` with ``A`` positive semi-definite and
    ``||A||_2 <= trace_bound`` (1 for ``G_s / N_s`` over unit-ball rows) and noise ``E`` with
    ``||E||_2 <= noise_norm_bound`` (w.h.p.), then sends ``P = U_R Lambda_R^{1/2}`` with the
    negative eigenvalues clipped to 0. Hence ``||P P^T||_2 = ||P||_2^2 <= trace_bound +
    noise_norm_bound``, and the columns of ``P`` are orthogonal (eigenvectors).

    Raises
    ------
    ProtocolError
        Naming the bound that failed.
    """
    if factor.ndim != 2 or factor.size == 0:
        raise ProtocolError(f"{name} must be a non-empty matrix, got shape {factor.shape}")
    bound = trace_bound + noise_norm_bound
    with np.errstate(over="ignore", invalid="ignore"):
        scale = float(np.max(np.abs(factor)))
        if not math.isfinite(scale) or scale * scale * factor.shape[1] > 1e300:
            raise ProtocolError(f"{name} has entries of magnitude {scale:.3g}; an honest "
                                f"release has ||{name} {name}^T||_2 <= {bound:.6g}")
        norm2 = float(np.linalg.norm(factor, 2)) ** 2
    if not norm2 <= bound * (1 + 1e-9):
        raise ProtocolError(f"||{name} {name}^T||_2 = {norm2:.6g} exceeds {bound:.6g}, the "
                            f"most an honest release can reach ({trace_bound:g} for the data "
                            f"plus {noise_norm_bound:.6g} for the noise)")
    gram = factor.T @ factor
    diag = np.diag(gram)
    off = gram - np.diag(diag)
    tol = 1e-8 * max(1.0, float(np.max(diag)))
    if float(np.max(np.abs(off))) > tol:
        raise ProtocolError(f"the columns of {name} are not orthogonal (max |<p_i, p_j>| = "
                            f"{float(np.max(np.abs(off))):.3g}); an honest release sends "
                            "eigenvectors scaled by the square roots of their eigenvalues")


def check_finite_values(value: Any, name: str) -> None:
    """Raise ValueError if a JSON-like value holds a NaN or infinite number anywhere."""
    if isinstance(value, bool | str) or value is None:
        return
    if isinstance(value, numbers.Real):
        if not math.isfinite(float(value)):
            raise ValueError(f"{name} is {float(value)!r}")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            check_finite_values(v, f"{name}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_finite_values(v, f"{name}[{i}]")
