"""HDMM's strategy templates and their losses: p-Identity, the convex L2 form, weighted marginals.

McKenna, Miklau, Hay & Machanavajjhala, "Optimizing error of high-dimensional statistical
queries under differential privacy" (HDMM), PVLDB 11(10), 2018, Sec. 5 (``OPT_0``), 6.2
(marginals); the L2 form is McKenna et al.'s convex ``X = A^T A`` programme (Yuan et al.
2016 give the same optimum). Reimplemented from the papers and HDMM's public code as a
specification; nothing is vendored. Every loss is the expected total squared error
``Delta^2 tr(W^T W (A^T A)^-1)`` with ``Delta`` the largest column norm of ``A`` (the
papers' normalisation; :mod:`dpfed.common.queries.matrix_mechanism` then prices the
replace-one sensitivity), and comes with its exact gradient for L-BFGS-B.

``p-Identity`` (L1 or L2)
    ``A = [I; Theta] D``, ``Theta >= 0`` (``p x n``), ``D`` normalising the columns.
``convex`` (L2)
    ``X = A^T A`` with unit diagonal, the strict lower triangle free: ``tr(X^-1 V)`` is convex
    in ``X``, so L-BFGS-B from HDMM's start reaches the global optimum; ``A = chol(X)``.
``marginals`` (L1 or L2), for workloads that are unions of weighted marginals
    ``A`` stacks ``w_S Q_S`` over the ``2^d`` attribute subsets ``S`` (``Q_S`` the marginal on
    ``S``). Grams ``M(v) = sum_S v_S (x)_i (I if i in S else J)`` form a commutative algebra,
    ``M(u) M(v) = M(X(u) v)`` with ``X(u)`` upper triangular in the subsets
    (``M(e_a) M(e_b) = prod_{i not in a|b} n_i M(e_{a&b})``), so the loss needs only
    ``2^d x 2^d`` work, never an ``n x n`` matrix.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import linalg

from dpfed.common.errors import ValidationError

# --------------------------------------------------------------------------- p-Identity


def pidentity_loss(theta_flat: np.ndarray, gram: np.ndarray, diag_gram: np.ndarray, p: int,
                   norm: str) -> tuple[float, np.ndarray]:
    """Loss ``||W A^+||_F^2`` of ``A = [I; Theta] diag(1/c)`` and its gradient in ``Theta``.

    ``c_j`` is the norm of column ``j`` of ``B = [I; Theta]``, so ``A`` has sensitivity 1.
    With ``M = B^T B = I + Theta^T Theta`` and ``X = diag(c) G diag(c)``,
    ``loss = tr(M^{-1} X)``. By Woodbury, ``M^{-1} = I - Theta^T R Theta`` with
    ``R = (I_p + Theta Theta^T)^{-1}`` (p x p), so one evaluation costs ``O(p n^2)``
    (HDMM, Sec. 5.2): ``loss = sum_j c_j^2 G_jj - tr(R Theta X Theta^T)``.

    Gradient: through ``M``, ``-2 R Theta X M^{-1}`` (using ``Theta M^{-1} = R Theta``);
    through ``c``, ``dloss/dc_j = 2 ((M^{-1} o G) c)_j`` times ``dc_j/dTheta_ij`` (1 for L1,
    ``Theta_ij / c_j`` for L2).
    """
    n = gram.shape[0]
    theta = theta_flat.reshape(p, n)
    if norm == "l1":
        c = 1.0 + theta.sum(axis=0)  # Theta >= 0 (L-BFGS-B bounds), so |.| is not needed
    else:
        c = np.sqrt(1.0 + (theta * theta).sum(axis=0))
    r = linalg.cho_solve(linalg.cho_factor(np.eye(p) + theta @ theta.T), np.eye(p))
    v = (theta * c) @ gram                      # Theta diag(c) G          (p x n), O(p n^2)
    z = v * c                                   # Theta X                  (p x n)
    loss = float(diag_gram @ (c * c) - np.sum(r * (z @ theta.T)))
    rz = r @ z
    grad = -2.0 * (rz - (rz @ theta.T) @ (r @ theta))          # through M
    h = 2.0 * (diag_gram * c - np.sum(theta * (r @ v), axis=0))  # dloss/dc
    if norm == "l1":
        grad += h[None, :]
    else:
        grad += h[None, :] * theta / c[None, :]
    return loss, np.asarray(grad, dtype=np.float64).ravel()


def pidentity_matrix(theta: np.ndarray, norm: str) -> np.ndarray:
    """Return ``[I; Theta]`` with every column scaled to norm 1 (L1 or L2)."""
    b = np.vstack([np.eye(theta.shape[1]), theta])
    c = np.abs(b).sum(axis=0) if norm == "l1" else np.sqrt((b * b).sum(axis=0))
    return np.asarray(b / c[None, :], dtype=np.float64)


# --------------------------------------------------------------------------- convex L2


class ConvexL2:
    """The L2 programme ``min tr(X^-1 V)`` over correlation matrices ``X`` (unit diagonal)."""

    def __init__(self, gram: np.ndarray) -> None:
        self.n = gram.shape[0]
        self.gram = gram
        self._mask = np.tri(self.n, k=-1, dtype=bool)

    def matrix_of(self, params: np.ndarray) -> np.ndarray:
        """Return ``X`` from its strict lower triangle."""
        x = np.zeros((self.n, self.n))
        x[self._mask] = params
        x += x.T
        np.fill_diagonal(x, 1.0)
        return x

    def start(self) -> np.ndarray:
        """Return HDMM's start: ``V^(1/2)`` rescaled to unit diagonal (the SVD-bound strategy)."""
        vals, vecs = np.linalg.eigh(self.gram)
        root = (vecs * np.sqrt(np.clip(vals, 0.0, None))) @ vecs.T
        d = np.sqrt(np.clip(np.diag(root), 1e-12, None))
        x = root / d[:, None] / d[None, :]
        # a small ridge keeps the start positive definite for rank-deficient workloads
        x = 0.99 * x + 0.01 * np.eye(self.n)
        return np.asarray(x[self._mask])

    def loss(self, params: np.ndarray) -> tuple[float, np.ndarray]:
        """Return ``tr(X^-1 V)`` and its gradient in the free entries (``-2 (X^-1 V X^-1)_ij``)."""
        x = self.matrix_of(params)
        try:
            factor = linalg.cho_factor(x, lower=True, check_finite=False)
        except linalg.LinAlgError:
            return math.inf, np.zeros_like(params)
        inv = linalg.cho_solve(factor, np.eye(self.n), check_finite=False)
        value = float(np.sum(inv * self.gram))
        g = inv @ self.gram @ inv
        return value, np.asarray(-2.0 * g[self._mask])

    def strategy(self, params: np.ndarray) -> np.ndarray:
        """Return ``A`` with ``A^T A = X`` (unit L2 columns)."""
        return np.asarray(linalg.cholesky(self.matrix_of(params), lower=False))


# --------------------------------------------------------------------------- marginals


class MarginalAlgebra:
    """Grams of weighted marginals over a product domain (module docstring).

    Subsets of the ``d`` attributes are bit masks, bit ``i`` for attribute ``i`` (the C-order
    axis ``i`` of the flattened histogram).
    """

    def __init__(self, domain: tuple[int, ...]) -> None:
        self.domain = domain
        self.d = len(domain)
        self.size = 1 << self.d
        self.n = math.prod(domain)
        keys = np.arange(self.size)
        # mult[s]: product of the sizes of the attributes not in s (J.J = n J)
        self.mult = np.array([math.prod(n for i, n in enumerate(domain) if not (s >> i) & 1)
                              for s in range(self.size)], dtype=np.float64)
        self._and = keys[:, None] & keys[None, :]
        self._or_mult = self.mult[keys[:, None] | keys[None, :]]

    def x_matrix(self, u: np.ndarray) -> np.ndarray:
        """Return ``X(u)`` with ``M(u) M(v) = M(X(u) v)``: ``X[a & b, b] += u_a mult[a | b]``."""
        out = np.zeros((self.size, self.size))
        contrib = u[:, None] * self._or_mult  # rows a, columns b
        cols = np.broadcast_to(np.arange(self.size)[None, :], contrib.shape)
        np.add.at(out, (self._and, cols), contrib)
        return out

    def trace_loss(self, u: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
        """Return ``tr(M(w) M(u)^-1)`` and its gradient in ``u`` (inf: ``M(u)`` singular)."""
        x = self.x_matrix(u)
        # a subset with no weight on any superset is not measured: solvable only if the
        # workload does not need it (HDMM's device: a unit diagonal there, then a check)
        unmeasured = np.diag(x) <= 0.0
        x[unmeasured, unmeasured] = 1.0
        phi = linalg.solve_triangular(x, w, lower=False, check_finite=False)
        if unmeasured.any():
            x[unmeasured, unmeasured] = 0.0
            if not np.allclose(x @ phi, w, rtol=1e-9, atol=1e-12 * float(np.abs(w).max())):
                return math.inf, np.zeros_like(u)
            x[unmeasured, unmeasured] = 1.0
        value = self.n * float(phi.sum())
        z = -linalg.solve_triangular(x.T, np.full(self.size, float(self.n)), lower=True,
                                     check_finite=False)
        # d value / d u_a = sum_b z[a & b] mult[a | b] phi[b]
        grad = np.sum(z[self._and] * self._or_mult * phi[None, :], axis=1)
        return value, np.asarray(grad)

    def gram(self, v: np.ndarray) -> np.ndarray:
        """Return the dense ``n x n`` Gram ``M(v)`` (tests and small domains)."""
        out = np.zeros((self.n, self.n))
        for s in range(self.size):
            if v[s] != 0.0:
                out += v[s] * _kron_parts(self.domain, s, gram=True)
        return out

    def weights_of(self, gram: np.ndarray) -> np.ndarray | None:
        """Return ``v`` with ``M(v) = gram``, or None if ``gram`` is not a marginals Gram.

        ``M(v)[x, y] = sum over S within agree(x, y) of v_S``; one pair of cells per
        agreement set and Moebius inversion give ``v``, then the whole Gram is compared.
        """
        if any(n < 2 for n in self.domain):
            return None
        g = np.zeros(self.size)
        cells = np.zeros(self.d, dtype=int)
        for t in range(self.size):
            other = np.array([0 if (t >> i) & 1 else 1 for i in range(self.d)])
            g[t] = gram[_flat(self.domain, cells), _flat(self.domain, other)]
        v = np.zeros(self.size)
        for s in range(self.size):
            for t in _subsets(s):
                v[s] += (-1) ** bin(s ^ t).count("1") * g[t]
        if not np.allclose(self.gram(v), gram, rtol=1e-9, atol=1e-9 * float(np.abs(gram).max())):
            return None
        return v

    def strategy(self, weights: np.ndarray) -> np.ndarray:
        """Return ``A`` stacking ``weights[S] Q_S`` over the subsets with a positive weight."""
        blocks = [weights[s] * _kron_parts(self.domain, s, gram=False)
                  for s in range(self.size) if weights[s] > 0.0]
        if not blocks:
            raise ValidationError("a marginals strategy needs a positive weight")
        return np.asarray(np.vstack(blocks))

    def strategy_rows(self, weights: np.ndarray) -> int:
        """Return the rows of :meth:`strategy` (checked against size limits before building)."""
        return int(sum(self.n // int(self.mult[s]) for s in range(self.size)
                       if weights[s] > 0.0))


def _subsets(s: int) -> list[int]:
    out, t = [], s
    while True:
        out.append(t)
        if t == 0:
            return out
        t = (t - 1) & s


def _flat(domain: tuple[int, ...], cell: np.ndarray) -> int:
    return int(np.ravel_multi_index(tuple(int(c) for c in cell), domain))


def _kron_parts(domain: tuple[int, ...], s: int, *, gram: bool) -> np.ndarray:
    out: np.ndarray = np.ones((1, 1))
    for i, n in enumerate(domain):
        if (s >> i) & 1:
            part = np.eye(n)
        else:
            part = np.ones((n, n)) if gram else np.ones((1, n))
        out = np.kron(out, part)
    return out


def all_subsets(d: int) -> list[tuple[int, ...]]:
    """Return the attribute subsets as tuples, in bit-mask order (for reports)."""
    return [tuple(i for i in range(d) if (s >> i) & 1) for s in range(1 << d)]


__all__ = ["ConvexL2", "MarginalAlgebra", "all_subsets", "pidentity_loss", "pidentity_matrix"]
