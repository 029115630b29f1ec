"""The matrix mechanism across sites under replace-one: site release, strategy transport, errors.

:mod:`dpfed.common.queries.matrix_mechanism` holds the strategies, reconstruction and the
workload algebra. This module adds what the federated ``query`` job needs on top, under the
system's single neighbouring relation, **replace-one** (a site's table keeps its N_s rows and
one row changes):

* :func:`replace_one_sensitivity` -- a replaced row moves one count down in cell ``i`` and one
  up in cell ``j``, so ``A x`` moves by ``a_j - a_i``: the sensitivity is the largest
  ``||a_i - a_j||`` over column pairs (L1 for Laplace, L2 for Gaussian), at most twice the
  largest column norm;
* :class:`SiteMatrixRelease` -- one site's ``A x_s + noise`` calibrated to it;
* :func:`strategy_digest` / :func:`named_strategy` -- how the coordinator sends a strategy
  the sites can verify (a name and ``n``, or the matrix plus its SHA-256 digest);
* :func:`per_query_std_error` -- the closed-form standard error of every workload answer
  after summing ``S`` sites' releases and reconstructing by least squares.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import linalg

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.queries.matrix_mechanism import strategy
from dpfed.common.queries.workloads import Workload
from dpfed.common.validation import check_choice, check_delta, check_epsilon, check_finite_array

__all__ = [
    "MAX_CELLS_NAMED",
    "MAX_CELLS_OPTIMIZED",
    "NAMED_STRATEGIES",
    "SiteMatrixRelease",
    "named_strategy",
    "per_query_std_error",
    "replace_one_sensitivity",
    "strategy_digest",
    "strategy_transport",
]

#: Strategies a site rebuilds from (name, n) itself.
NAMED_STRATEGIES: tuple[str, ...] = ("identity", "h2", "wavelet", "prefix")
#: Largest domain for a named strategy: each site builds the k x n matrix (k <= 2n) and its
#: exact replace-one sensitivity needs A^T A (O(k n^2) work), about a second at n = 1024.
MAX_CELLS_NAMED = 1024
#: Largest domain for the optimised strategy: the coordinator's optimiser (L-BFGS over a
#: p x n parameter) takes minutes beyond this, and the (n + p) x n matrix is sent to every site.
MAX_CELLS_OPTIMIZED = 512
#: Pairwise differences are computed directly (exactly) up to this many k*n*n operations.
_DIRECT_PAIRWISE_OPS = 60_000_000


def strategy_digest(matrix: np.ndarray) -> str:
    """SHA-256 over the shape and the float64 C-order bytes of a strategy matrix."""
    a = np.ascontiguousarray(matrix, dtype=np.float64)
    h = hashlib.sha256(f"strategy|{a.shape[0]}x{a.shape[1]}|".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def strategy_transport(name: str, matrix: np.ndarray, n: int
                       ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Return how a strategy travels to the sites: its task spec and arrays.

    A named strategy travels as ``(name, n)`` (each site rebuilds it); any other as the
    ``matrix`` spec with its digest and shape, plus the matrix as the ``strategy`` array.
    """
    if name in NAMED_STRATEGIES:
        return {"name": name, "n": n}, {}
    a = np.ascontiguousarray(matrix, dtype=np.float64)
    return ({"name": "matrix", "digest": strategy_digest(a),
             "shape": [int(a.shape[0]), int(a.shape[1])]}, {"strategy": a})


def named_strategy(name: str, n: int) -> np.ndarray:
    """Rebuild a named (data-independent) strategy for ``n`` cells, within the size limit."""
    check_choice(name, "strategy", NAMED_STRATEGIES)
    if n > MAX_CELLS_NAMED:
        raise ValidationError(f"strategy {name!r} is limited to {MAX_CELLS_NAMED} cells (each "
                              f"site builds the matrix and its exact sensitivity); the domain "
                              f"has {n}")
    return strategy(name, n)


def _two_valued(a: np.ndarray) -> float | None:
    """Return ``c`` if every entry is 0 or one common ``c > 0`` (0/1 matrices: 1), else None.

    Such matrices include 0/1 strategies and their integer fixed-point encodings ``s A``.
    """
    nonzero = a[a != 0.0]
    if nonzero.size == 0:
        return None
    c = float(nonzero.flat[0])
    return c if c > 0.0 and bool(np.all(nonzero == c)) else None


def replace_one_sensitivity(matrix: Any, norm: str) -> tuple[float, bool]:
    """Return the replace-one sensitivity of ``x -> A x`` and whether it is exact.

    Parameters
    ----------
    matrix : array_like, shape (k, n)
        The strategy ``A``.
    norm : {"l1", "l2"}
        L1 for Laplace noise, L2 for Gaussian noise.

    Returns
    -------
    (float, bool)
        ``max_{i != j} ||a_i - a_j||`` (the exact value, flag True) or, for a large matrix
        with entries other than 0 and one value ``c`` under L1, the upper bound
        ``2 max_j ||a_j||_1`` (flag False; still a valid calibration). For ``n = 1`` every
        row is in the one cell, the histogram is the public N_s and the sensitivity is 0.

    Privacy
    -------
    Replace-one: one row of the site moves from cell ``i`` to cell ``j`` (``i = j`` changes
    nothing), so ``x' = x - e_i + e_j`` and ``A x' - A x = a_j - a_i``. The worst case over all
    pairs is the sensitivity. Computed exactly: directly for small matrices; through the Gram
    matrix ``G = A^T A`` for L2 (``||a_i - a_j||^2 = G_ii + G_jj - 2 G_ij``) and for
    matrices whose entries are 0 or one value ``c`` under L1 (``|a - b| = a + b - 2ab/c``
    entrywise; 0/1 strategies and their fixed-point encodings ``s A``).
    """
    a = check_finite_array(matrix, "strategy matrix", ndim=2)
    check_choice(norm, "norm", ("l1", "l2"))
    k, n = a.shape
    if n == 1:
        return 0.0, True
    c = None if norm == "l2" else _two_valued(a)
    if norm == "l2" or c is not None:
        g = a.T @ a
        d = np.diag(g)
        sq = d[:, None] + d[None, :] - 2.0 * g
        if c is None:
            return float(math.sqrt(max(0.0, float(sq.max())))), True
        # entries in {0, c}: |a - b| = a + b - 2ab/c entrywise and a_i.a_i = c ||a_i||_1
        return float(sq.max()) / c, True
    if k * n * n <= _DIRECT_PAIRWISE_OPS:
        best = 0.0
        step = max(1, _DIRECT_PAIRWISE_OPS // max(1, 8 * k * n))
        for start in range(0, n, step):
            block = a[:, start:start + step]  # k x b
            diff = np.abs(block[:, :, None] - a[:, None, :]).sum(axis=0)
            best = max(best, float(diff.max()))
        return best, True
    return 2.0 * float(np.abs(a).sum(axis=0).max()), False


@dataclass(frozen=True, eq=False)
class SiteMatrixRelease:
    """One site's ``A x_s + noise`` under replace-one.

    Attributes
    ----------
    strategy_matrix : ndarray, shape (k, n)
        The public strategy (verified by name or digest before use).
    epsilon : float
        Privacy parameter (> 0).
    delta : float
        0 for Laplace; in (0, 1) for Gaussian.
    noise : {"laplace", "gaussian"}
        Noise distribution.
    sensitivity : float
        Replace-one sensitivity (:func:`replace_one_sensitivity`).
    sensitivity_exact : bool
        False when the upper bound was used.
    noise_scale : float
        Laplace ``b = Delta_1 / epsilon`` or Gaussian ``sigma`` (analytic calibration).
    noise_variance : float
        ``2 b^2`` or ``sigma^2`` per entry.

    Privacy
    -------
    Replace-one neighbours; a histogram row of counts over public cells (every row in exactly
    one cell); sensitivity ``max_{i,j} ||a_i - a_j||`` (L1 / L2); iid ``Lap(Delta_1 / eps)``
    per entry (eps-DP) or ``N(0, sigma^2)`` with ``sigma = gaussian_sigma(eps, delta,
    Delta_2)`` (analytic, Balle & Wang 2018; (eps, delta)-DP). Summation across sites and
    reconstruction are post-processing.
    """

    strategy_matrix: np.ndarray
    epsilon: float
    delta: float = 0.0
    noise: str = "laplace"
    sensitivity: float = field(init=False)
    sensitivity_exact: bool = field(init=False)
    noise_scale: float = field(init=False)
    noise_variance: float = field(init=False)

    def __post_init__(self) -> None:
        a = check_finite_array(self.strategy_matrix, "strategy matrix", ndim=2)
        noise = check_choice(self.noise, "noise", ("laplace", "gaussian"))
        eps = check_epsilon(self.epsilon)
        if noise == "laplace":
            if self.delta != 0.0:
                raise ValidationError(f"Laplace noise is pure epsilon-DP: delta must be 0, got "
                                      f"{self.delta!r}")
            delta = 0.0
        else:
            delta = check_delta(self.delta)
        sens, exact = replace_one_sensitivity(a, "l1" if noise == "laplace" else "l2")
        if sens <= 0.0:
            raise ValidationError("the strategy's answers do not depend on the histogram beyond "
                                  "its total (sensitivity 0); nothing to release")
        if noise == "laplace":
            scale = sens / eps
            var = 2.0 * scale * scale
        else:
            scale = gaussian_sigma(eps, delta, sens, "analytic")
            var = scale * scale
        a = a.copy()
        a.setflags(write=False)
        for key, value in (("strategy_matrix", a), ("epsilon", eps), ("delta", delta),
                           ("noise", noise), ("sensitivity", sens), ("sensitivity_exact", exact),
                           ("noise_scale", scale), ("noise_variance", var)):
            object.__setattr__(self, key, value)

    def cost(self) -> PrivacyCost:
        """Return the ledger cost of one release."""
        if self.noise == "laplace":
            return PrivacyCost.pure(self.epsilon, mechanism="matrix-laplace",
                                    sensitivity=self.sensitivity, noise_scale=self.noise_scale)
        return PrivacyCost.gaussian(self.epsilon, self.delta, sigma=self.noise_scale,
                                    sensitivity=self.sensitivity, mechanism="matrix-gaussian")

    def release(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Return ``A x + noise`` for the site's histogram ``x`` (n counts)."""
        v = check_finite_array(x, "histogram", ndim=1)
        if v.shape[0] != self.strategy_matrix.shape[1]:
            raise ValidationError(f"histogram has {v.shape[0]} cells, the strategy "
                                  f"{self.strategy_matrix.shape[1]}")
        y = self.strategy_matrix @ v
        if self.noise == "laplace":
            return np.asarray(y + rng.laplace(0.0, self.noise_scale, size=y.shape))
        return np.asarray(y + self.noise_scale * rng.standard_normal(size=y.shape))


def _pinv_gram(a: np.ndarray) -> np.ndarray:
    ata = a.T @ a
    try:
        c = linalg.cho_factor(ata)
        d = np.abs(np.diag(c[0]))
        if d.min() > 1e-7 * d.max():
            return np.asarray(linalg.cho_solve(c, np.eye(ata.shape[0])))
    except linalg.LinAlgError:
        pass
    return np.asarray(np.linalg.pinv(ata, hermitian=True))


def per_query_std_error(workload: Workload, strategy_matrix: np.ndarray, *,
                        noise_variance: float, n_sites: int) -> np.ndarray:
    """Closed-form standard error of each workload answer (least squares, ``S`` sites summed).

    The summed release is ``A x + z`` with ``Cov(z) = S v I`` (``v`` one entry's variance), so
    ``x_hat = A^+ y`` has covariance ``S v (A^T A)^+`` and query ``w`` has variance
    ``S v w^T (A^T A)^+ w``. Computed without materialising ``W`` for identity, prefix and
    all-range workloads (2-D prefix sums of ``P = (A^T A)^+``).
    """
    a = check_finite_array(strategy_matrix, "strategy matrix", ndim=2)
    p = _pinv_gram(a)
    n = p.shape[0]
    if workload.n != n:
        raise ValidationError(f"workload over {workload.n} cells, strategy over {n}")
    if workload.matrix is not None:
        w = workload.matrix
        var = np.einsum("ij,jk,ik->i", w, p, w, optimize=True)
    elif workload.kind == "identity":
        var = np.diag(p).copy()
    else:
        c = np.zeros((n + 1, n + 1))
        c[1:, 1:] = p.cumsum(axis=0).cumsum(axis=1)
        if workload.kind == "prefix":
            j = np.arange(1, n + 1)
            var = c[j, j]
        elif workload.kind == "all_ranges":
            i, j = np.triu_indices(n)
            hi = j + 1
            var = c[hi, hi] - c[i, hi] - c[hi, i] + c[i, i]
        else:
            raise ValidationError(f"cannot compute per-query errors of an implicit "
                                  f"{workload.kind!r} workload")
    return np.asarray(np.sqrt(np.maximum(var, 0.0) * noise_variance * n_sites))
