"""Linear-query workloads over a histogram domain, for the matrix mechanism.

A *workload* is a set of ``m`` linear counting queries over a histogram ``x`` of ``n`` cells,
written as an ``m x n`` matrix ``W`` whose answers are ``W x``. The matrix mechanism
(:mod:`dpfed.common.queries.matrix_mechanism`) only needs ``W`` through its Gram matrix ``W^T W``
(an
``n x n`` matrix) and its number of queries ``m``: the expected error of a strategy ``A`` is
``||W A^+||_F^2 = tr(A^+^T (W^T W) A^+)``. That is what makes large workloads affordable:
all ranges over ``n = 2048`` cells is 2,098,176 queries, but its Gram matrix has a closed form
(:func:`all_range_workload`) and the query matrix is never built.

A :class:`Workload` therefore carries the Gram matrix always, the query matrix ``W`` when it
is small enough to hold (``matrix``), and a ``kind`` that lets :meth:`Workload.answer`
compute the answers of the structured implicit workloads (all ranges, prefixes) without
``W``. Workloads are public (the analyst's questions), never data.

Constructors
------------
:func:`identity_workload`, :func:`all_range_workload`, :func:`prefix_workload`,
:func:`marginal_workload` (k-way marginals of a small product domain),
:func:`custom_workload` (any matrix) and :func:`gram_workload` (any Gram matrix, implicit).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_finite_array, check_int

#: Workload kinds whose answers :meth:`Workload.answer` can compute without the matrix.
WORKLOAD_KINDS: tuple[str, ...] = ("identity", "all_ranges", "prefix", "marginals", "custom")

#: Largest query matrix (m * n entries) the constructors will materialise on request.
MAX_EXPLICIT_ENTRIES = 50_000_000


def _readonly(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.float64, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class Workload:
    """A set of linear queries over a histogram of ``n`` cells.

    Build one with the constructor functions of this module rather than directly.

    Attributes
    ----------
    name : str
        Human-readable label, e.g. ``"all_ranges(256)"``.
    kind : {"identity", "all_ranges", "prefix", "marginals", "custom"}
        The structure; decides how :meth:`answer` works when ``matrix`` is None.
    domain : tuple of int
        The histogram's shape; ``n = prod(domain)`` cells, flattened in C order.
    n_queries : int
        Number of queries ``m`` (rows of ``W``), used to turn total error into per-query error.
    gram : ndarray, shape (n, n)
        ``W^T W`` (read-only).
    matrix : ndarray, shape (m, n), or None
        ``W`` itself when materialised (read-only), else None (implicit workload).
    """

    name: str
    kind: str
    domain: tuple[int, ...]
    n_queries: int
    gram: np.ndarray
    matrix: np.ndarray | None = None
    n: int = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            allowed = ", ".join(repr(k) for k in WORKLOAD_KINDS)
            raise ValidationError(f"workload kind must be one of {allowed}, got {self.kind!r}")
        domain = tuple(check_int(d, "domain size", minimum=1) for d in self.domain)
        if not domain:
            raise ValidationError("domain must have at least one dimension, got ()")
        n = math.prod(domain)
        m = check_int(self.n_queries, "n_queries", minimum=1)
        gram = check_finite_array(self.gram, "gram", ndim=2)
        if gram.shape != (n, n):
            raise ValidationError(f"gram must have shape ({n}, {n}) for a domain of {n} cells, "
                                  f"got {gram.shape}")
        if not np.allclose(gram, gram.T, rtol=1e-10, atol=1e-10 * max(1.0, float(
                np.abs(gram).max(initial=0.0)))):
            raise ValidationError("gram must be symmetric (it is W^T W)")
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "n_queries", m)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "gram", _readonly(gram))
        if self.matrix is not None:
            w = check_finite_array(self.matrix, "workload matrix", ndim=2)
            if w.shape != (m, n):
                raise ValidationError(f"workload matrix must have shape ({m}, {n}), "
                                      f"got {w.shape}")
            object.__setattr__(self, "matrix", _readonly(w))

    @property
    def is_explicit(self) -> bool:
        """True when the query matrix ``W`` is materialised."""
        return self.matrix is not None

    def answer(self, x: Any) -> np.ndarray:
        """Return the ``m`` query answers ``W x`` for a histogram (or estimate) ``x``.

        Works without ``W`` for the structured kinds: all ranges (prefix-sum differences, in
        the order ``[i, j]`` for ``i = 0..n-1``, ``j = i..n-1``), prefixes and identity. A
        workload given only by a Gram matrix (:func:`gram_workload`) cannot be answered.

        Parameters
        ----------
        x : array_like, shape (n,)
            A histogram or an estimate of one (may be negative: estimates are not clipped).
        """
        v = check_finite_array(x, "x", ndim=1)
        if v.shape[0] != self.n:
            raise ValidationError(f"x must have length {self.n} (the workload's domain), "
                                  f"got {v.shape[0]}")
        if self.matrix is not None:
            return np.asarray(self.matrix @ v, dtype=np.float64)
        if self.kind == "identity":
            return v.copy()
        if self.kind == "prefix":
            return np.cumsum(v)
        if self.kind == "all_ranges":
            # sum(x[i..j]) = P[j + 1] - P[i] with P the prefix sums (P[0] = 0).
            p = np.concatenate(([0.0], np.cumsum(v)))
            i, j = np.triu_indices(self.n)
            return np.asarray(p[j + 1] - p[i], dtype=np.float64)
        raise ValidationError(
            f"workload {self.name!r} was given only by its Gram matrix W^T W; its individual "
            "queries are unknown, so it cannot be answered (give the matrix instead)"
        )


def _check_n(n: Any) -> int:
    return check_int(n, "n", minimum=1)


def _check_explicit_size(m: int, n: int, name: str) -> None:
    if m * n > MAX_EXPLICIT_ENTRIES:
        raise ValidationError(
            f"{name} has {m} queries over {n} cells ({m * n} matrix entries, more than "
            f"{MAX_EXPLICIT_ENTRIES}); use explicit=False (the Gram matrix is exact)"
        )


def identity_workload(n: int) -> Workload:
    """Return the ``n`` single-cell counts (``W = I``)."""
    n = _check_n(n)
    eye = np.eye(n)
    return Workload(f"identity({n})", "identity", (n,), n, gram=eye,
                    matrix=eye if n * n <= MAX_EXPLICIT_ENTRIES else None)


def all_range_gram(n: int) -> np.ndarray:
    """Return ``W^T W`` for all ``n(n+1)/2`` range queries over ``n`` cells, in closed form.

    Entry ``(j, k)`` counts the ranges ``[a, b]`` (0-based, ``a <= b``) that contain both
    cells: ``a <= min(j, k)`` and ``b >= max(j, k)``, i.e. ``(min(j, k) + 1) (n - max(j, k))``.
    """
    n = _check_n(n)
    idx = np.arange(n)
    lo = np.minimum.outer(idx, idx)
    hi = np.maximum.outer(idx, idx)
    gram: np.ndarray = ((lo + 1) * (n - hi)).astype(np.float64)
    return gram


def _all_range_matrix(n: int) -> np.ndarray:
    i, j = np.triu_indices(n)
    cols = np.arange(n)
    return ((cols[None, :] >= i[:, None]) & (cols[None, :] <= j[:, None])).astype(np.float64)


def all_range_workload(n: int, *, explicit: bool = False) -> Workload:
    """Return all ranges ``sum(x[a..b])``, ``0 <= a <= b < n``: ``n(n+1)/2`` queries.

    Parameters
    ----------
    n : int
        Number of cells.
    explicit : bool
        Also materialise ``W`` (only for small ``n``; tests compare it with the closed-form
        Gram matrix). By default the workload is implicit: Gram matrix plus query count.
    """
    n = _check_n(n)
    m = n * (n + 1) // 2
    matrix = None
    if explicit:
        _check_explicit_size(m, n, "all_range_workload")
        matrix = _all_range_matrix(n)
    return Workload(f"all_ranges({n})", "all_ranges", (n,), m, gram=all_range_gram(n),
                    matrix=matrix)


def prefix_gram(n: int) -> np.ndarray:
    """Return ``W^T W`` for the ``n`` prefix queries ``sum(x[0..b])``: entry ``n - max(j, k)``."""
    n = _check_n(n)
    idx = np.arange(n)
    return (n - np.maximum.outer(idx, idx)).astype(np.float64)


def prefix_workload(n: int) -> Workload:
    """Return the ``n`` prefix queries ``sum(x[0..b])`` (a cumulative distribution)."""
    n = _check_n(n)
    matrix = np.tril(np.ones((n, n))) if n * n <= MAX_EXPLICIT_ENTRIES else None
    return Workload(f"prefix({n})", "prefix", (n,), n, gram=prefix_gram(n), matrix=matrix)


def marginal_workload(domain: Any, k: int) -> Workload:
    """Return all k-way marginals of a histogram over a small product domain.

    The histogram is the C-order flattening of an array of shape ``domain``. For every set
    ``S`` of ``k`` attributes, the marginal on ``S`` is ``kron`` over attributes of ``I``
    (attribute in ``S``) or a row of ones (summed out); the workload stacks all of them.

    Parameters
    ----------
    domain : sequence of int
        Number of levels of each attribute (each >= 1).
    k : int
        Marginal order, ``0 <= k <= len(domain)`` (0 is the total count).
    """
    try:
        sizes = tuple(domain)
    except TypeError:
        raise ValidationError(f"domain must be a sequence of ints, got {domain!r}") from None
    sizes = tuple(check_int(d, "domain size", minimum=1) for d in sizes)
    if not sizes:
        raise ValidationError("domain must have at least one attribute, got ()")
    k = check_int(k, "k", minimum=0, maximum=len(sizes))
    n = math.prod(sizes)
    blocks = []
    for subset in itertools.combinations(range(len(sizes)), k):
        block: np.ndarray = np.ones((1, 1))
        for axis, size in enumerate(sizes):
            factor = np.eye(size) if axis in subset else np.ones((1, size))
            block = np.kron(block, factor)
        blocks.append(block)
    m = sum(b.shape[0] for b in blocks)
    _check_explicit_size(m, n, "marginal_workload")
    matrix = np.vstack(blocks)
    label = "x".join(str(s) for s in sizes)
    return Workload(f"marginals{k}({label})", "marginals", sizes, m, gram=matrix.T @ matrix,
                    matrix=matrix)


def custom_workload(matrix: Any, *, name: str = "custom", domain: Any = None) -> Workload:
    """Return the workload of an explicit query matrix ``W`` (``m x n``).

    Parameters
    ----------
    matrix : array_like, shape (m, n)
        One query per row, finite.
    name : str
        Label for reports.
    domain : sequence of int, optional
        The histogram's shape if it is multi-dimensional (product must be ``n``).
    """
    w = check_finite_array(matrix, "workload matrix", ndim=2)
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValidationError(f"workload matrix must be non-empty, got shape {w.shape}")
    shape = (w.shape[1],) if domain is None else tuple(domain)
    return Workload(name, "custom", shape, w.shape[0], gram=w.T @ w, matrix=w)


def gram_workload(gram: Any, n_queries: int, *, name: str = "custom-gram",
                  domain: Any = None) -> Workload:
    """Return an implicit workload given only its Gram matrix ``W^T W`` and query count.

    Enough for strategy selection and expected error, not for :meth:`Workload.answer`.

    Parameters
    ----------
    gram : array_like, shape (n, n)
        Symmetric positive semi-definite ``W^T W``.
    n_queries : int
        Number of queries ``m`` the Gram matrix stands for.
    name : str
        Label for reports.
    domain : sequence of int, optional
        The histogram's shape if multi-dimensional.
    """
    g = check_finite_array(gram, "gram", ndim=2)
    if g.shape[0] != g.shape[1] or g.shape[0] < 1:
        raise ValidationError(f"gram must be a non-empty square matrix, got shape {g.shape}")
    eig_min = float(np.linalg.eigvalsh((g + g.T) / 2.0).min())
    if eig_min < -1e-9 * max(1.0, float(np.abs(g).max())):
        raise ValidationError(f"gram must be positive semi-definite (it is W^T W); its "
                              f"smallest eigenvalue is {eig_min:.3g}")
    shape = (g.shape[0],) if domain is None else tuple(domain)
    return Workload(name, "custom", shape, n_queries, gram=g)
