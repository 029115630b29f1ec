"""The matrix mechanism: answer a linear-query workload through a noisy *strategy*.

Seed 004 (docs/algorithms.md, "Matrix mechanism": sources, which strategy pays, deviations).
1. :func:`strategy` picks ``A`` (``k x n``) for the workload ``W`` over a histogram ``x`` of
   ``n`` cells (identity, H2, Haar wavelet, prefix, optimised: HDMM's OPT_0 templates), from public
   inputs only; :func:`best_strategy` ranks them by expected RMSE.
2. :class:`MatrixMechanism` / :func:`release` draw ``y = A x + noise`` (Laplace or analytic
   Gaussian) calibrated to the replace-one sensitivity of the matrix actually used
   (:func:`sensitivity`); a site never takes a sensitivity from the task.
3. :func:`reconstruct` solves ``x_hat = A^+ y`` (optionally NNLS or the seed's L1 programme),
   :func:`combine_releases` sums sites' answers first, :func:`answer` gives ``W x_hat``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import linalg

from dpfed.common.errors import DpfedError, ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.rng import resolve_rng
from dpfed.common.queries.strategy_templates import (
    ConvexL2,
    MarginalAlgebra,
    pidentity_loss,
    pidentity_matrix,
)
from dpfed.common.queries.workloads import Workload, custom_workload
from dpfed.common.validation import (
    check_choice,
    check_delta,
    check_epsilon,
    check_finite_array,
    check_int,
    check_positive,
)

if TYPE_CHECKING:
    from scipy import optimize

logger = logging.getLogger(__name__)

#: Names accepted by :func:`strategy`.
STRATEGIES: tuple[str, ...] = ("identity", "h2", "wavelet", "prefix", "optimized")
#: Noise distributions accepted by :class:`MatrixMechanism`.
NOISES: tuple[str, ...] = ("laplace", "gaussian")
#: Non-negativity steps accepted by :func:`reconstruct` (besides None).
NONNEGATIVE_METHODS: tuple[str, ...] = ("nnls", "l1")
#: Sensitivity norms: Laplace uses column L1 norms, Gaussian column L2 norms.
NORMS: tuple[str, ...] = ("l1", "l2")

_NOISE_NORM = {"laplace": "l1", "gaussian": "l2"}
_DEFAULT_OPTIMIZER_SEED = 0
#: Largest domain :func:`optimize_strategy` plans for (dense n x n work per optimiser step).
MAX_OPTIMIZED_CELLS = 2048
#: Largest domain on which Gaussian noise uses the convex programme (O(n^3) per step).
CONVEX_MAX_CELLS = 512
#: Most attributes of a marginals workload the marginals template handles (2^d subsets).
MAX_MARGINAL_ATTRIBUTES = 10
#: Largest optimised strategy matrix built (rows x cells).
MAX_STRATEGY_ENTRIES = 20_000_000
#: Default wall-clock bound of :func:`optimize_strategy`, in seconds.
DEFAULT_TIME_LIMIT_S = 30.0
# Relative loss decrease at which L-BFGS-B stops. Much looser than scipy's 2.2e-9: on all
# ranges it keeps all but 0.2% of the RMSE gain (n = 256: 1.622x vs 1.627x for Laplace) in
# a tenth (n = 256) to a third (n = 1024) of the iterations.
_OPTIMIZER_FTOL = 1e-5
# Largest (pairs of columns) x (rows) for which the exact L1 replace-one sensitivity is
# computed (about a second of scipy cdist); above it the 2 x max-column-norm bound is used.
_EXACT_L1_WORK = 3e8
# The same for L2 (one Gram matrix A^T A, BLAS): k n^2 multiply-adds.
_EXACT_L2_WORK = 2e10
#: How :func:`sensitivity_with_method` obtained a figure.
SENSITIVITY_METHODS: tuple[str, ...] = ("exact-pairs", "2x-max-column")


# --------------------------------------------------------------------------- validation


def _check_strategy_matrix(strategy_matrix: Any, name: str = "strategy_matrix") -> np.ndarray:
    """Return ``A`` as a finite 2-D float array with at least one row and column."""
    a = check_finite_array(strategy_matrix, name, ndim=2)
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise ValidationError(f"{name} must have at least one row and one column, "
                              f"got shape {a.shape}")
    if not np.any(a):
        raise ValidationError(f"{name} must not be all zeros")
    return a


def _check_histogram(x: Any, n: int) -> np.ndarray:
    """Return ``x`` if it is a finite, non-negative 1-D histogram of ``n`` cells."""
    v = check_finite_array(x, "x", ndim=1)
    if v.shape[0] != n:
        raise ValidationError(f"x must have length {n} (the strategy's number of columns), "
                              f"got {v.shape[0]}")
    if np.any(v < 0):
        raise ValidationError(f"x must be a histogram of counts (all >= 0), got a minimum of "
                              f"{float(v.min())!r}")
    return v


def _check_noise(noise: Any, epsilon: Any, delta: Any) -> tuple[str, float, float | None]:
    """Validate (noise, epsilon, delta): Gaussian needs delta, Laplace refuses one."""
    noise = check_choice(noise, "noise", NOISES)
    eps = check_epsilon(epsilon)
    if noise == "gaussian":
        if delta is None:
            raise ValidationError("delta is required for noise='gaussian' (in (0, 1)), got None")
        return noise, eps, check_delta(delta)
    if delta is not None:
        raise ValidationError(
            f"delta must be None for noise='laplace' (pure epsilon-DP), got {delta!r}; "
            "use noise='gaussian' for (epsilon, delta)-DP"
        )
    return noise, eps, None


def _as_workload(workload: Any, n: int | None = None) -> Workload:
    """Accept a :class:`Workload` or an explicit query matrix ``W``."""
    w = workload if isinstance(workload, Workload) else custom_workload(workload)
    if n is not None and w.n != n:
        raise ValidationError(f"workload has {w.n} cells but the strategy has {n} columns")
    return w


# --------------------------------------------------------------------------- sensitivity


def column_norm(strategy_matrix: Any, norm: str = "l1") -> float:
    """Return the largest column norm of ``A`` (L1 or L2).

    This is the sensitivity of ``x -> A x`` under *add/remove* one record (one cell moves by
    1; Li et al. 2010, Prop. 4), the normalisation of the papers and of HDMM's published
    table. dpfed's releases use :func:`sensitivity` (replace-one), which is at most twice it.
    """
    a = _check_strategy_matrix(strategy_matrix)
    check_choice(norm, "norm", NORMS)
    if norm == "l1":
        return float(np.abs(a).sum(axis=0).max())
    return float(np.sqrt((a * a).sum(axis=0)).max())


def _max_pair_distance_l1(a: np.ndarray) -> float:
    """``max_{i < j} ||a_i - a_j||_1`` over the columns, in blocks of rows of ``A^T``."""
    from scipy.spatial import distance  # local: only needed here

    columns = np.ascontiguousarray(a.T)
    n = columns.shape[0]
    block = max(1, int(4_000_000 // max(n, 1)))
    worst = 0.0
    for start in range(0, n - 1, block):
        stop = min(n - 1, start + block)
        # Every entry is the distance of two columns (0 where a column meets itself).
        d = distance.cdist(columns[start:stop], columns[start + 1:], "cityblock")
        worst = max(worst, float(d.max()))
    return worst


def _max_pair_distance_l2(a: np.ndarray) -> float:
    """``max_{i < j} ||a_i - a_j||_2`` from the Gram matrix ``A^T A``."""
    gram = a.T @ a
    sq = np.diag(gram).copy()
    d2 = sq[:, None] + sq[None, :] - 2.0 * gram
    np.fill_diagonal(d2, 0.0)
    return math.sqrt(max(float(d2.max()), 0.0))


def sensitivity_with_method(strategy_matrix: Any, norm: str = "l1") -> tuple[float, str]:
    """Return the replace-one sensitivity of ``x -> A x`` and how it was obtained.

    ``"exact-pairs"``: ``max_{i != j} ||a_i - a_j||`` over the columns, computed whenever it is
    affordable (L2 from one Gram matrix when ``k n^2 <= 2e10``; L1 by pairwise distances when
    ``k n (n - 1) / 2 <= 3e8``). ``"2x-max-column"``: otherwise the bound ``2 max_j ||a_j||``
    (triangle inequality), which is never below the exact value. Both parties derive it from
    the same matrix with the same rule, so they always agree. See :func:`sensitivity`.
    """
    a = _check_strategy_matrix(strategy_matrix)
    check_choice(norm, "norm", NORMS)
    k, n = a.shape
    bound = 2.0 * column_norm(a, norm)
    if n < 2:
        # One cell: a replacement leaves the histogram unchanged (its count is the public N).
        return 0.0, "exact-pairs"
    if norm == "l1" and k * n * (n - 1) / 2 <= _EXACT_L1_WORK:
        return min(_max_pair_distance_l1(a), bound), "exact-pairs"
    if norm == "l2" and k * n * n <= _EXACT_L2_WORK:
        return min(_max_pair_distance_l2(a), bound), "exact-pairs"
    return bound, "2x-max-column"


def sensitivity(strategy_matrix: Any, norm: str = "l1") -> float:
    """Return the sensitivity of ``x -> A x`` under replace-one record.

    Parameters
    ----------
    strategy_matrix : array_like, shape (k, n)
        The strategy ``A``.
    norm : {"l1", "l2"}
        ``"l1"`` for Laplace noise, ``"l2"`` for Gaussian noise.

    Privacy
    -------
    Neighbouring relation: replace-one record with the record count public (docs/privacy.md).
    ``x`` is a histogram in which each record adds 1 to exactly one cell (its bin, from the
    public schema), so replacing a record moves one count from cell ``i`` to cell ``j``:
    ``x' = x - e_i + e_j`` and ``A x' - A x = a_j - a_i``. The largest change in the chosen
    norm is therefore ``max_{i != j} ||a_i - a_j||`` (0 for a single cell), at most twice the
    largest column norm (:func:`column_norm`, the add/remove figure of Li et al. 2010) and
    equal to it only when no two columns can be told apart by more. Computed exactly where
    affordable, else the 2x bound: :func:`sensitivity_with_method` says which.
    """
    return sensitivity_with_method(strategy_matrix, norm)[0]


# --------------------------------------------------------------------------- fixed strategies


def identity_strategy(n: int) -> np.ndarray:
    """Return ``I_n``: every cell counted once (``Delta_1 = Delta_2 = 1``)."""
    n = check_int(n, "n", minimum=1)
    return np.eye(n)


def _h2_intervals(n: int) -> list[tuple[int, int]]:
    """Nodes ``[start, end)`` of a balanced binary tree over ``n`` cells, root first."""
    nodes: list[tuple[int, int]] = []
    level = [(0, n)]
    while level:
        nodes.extend(level)
        nxt = []
        for start, end in level:
            if end - start > 1:
                mid = start + (end - start + 1) // 2  # left child takes the extra cell
                nxt.extend([(start, mid), (mid, end)])
        level = nxt
    return nodes


def h2_strategy(n: int) -> np.ndarray:
    """Return the hierarchical strategy H2: every node of a binary tree over the cells.

    Row ``r`` counts the cells of tree node ``r`` (root = all cells, leaves = single cells),
    ``2n - 1`` rows. Each cell lies on one root-to-leaf path, so for ``n = 2^L`` every column
    has ``L + 1`` ones: ``Delta_1 = log2(n) + 1`` and ``Delta_2 = sqrt(log2(n) + 1)``. For
    other ``n`` the split puts the extra cell left (as Ektelo's ``H2``), and the sensitivity
    is the deepest path, ``ceil(log2(n)) + 1`` in L1. Hay et al., PVLDB 2010.
    """
    n = check_int(n, "n", minimum=1)
    nodes = _h2_intervals(n)
    a = np.zeros((len(nodes), n))
    for row, (start, end) in enumerate(nodes):
        a[row, start:end] = 1.0
    return a


def _haar_power_of_two(size: int) -> np.ndarray:
    """Unnormalised Haar matrix for ``size = 2^L``: the total, then +1/-1 half differences."""
    h = np.ones((1, 1))
    while h.shape[1] < size:
        m = h.shape[1]
        h = np.vstack([np.kron(h, [1.0, 1.0]), np.kron(np.eye(m), [1.0, -1.0])])
    return h


def wavelet_strategy(n: int) -> np.ndarray:
    """Return the (unnormalised) Haar wavelet strategy, as in Ektelo's ``Wavelet``.

    Rows are the total count and, for every dyadic interval, its left half minus its right
    half (entries 0, +1, -1). For ``n = 2^L`` it is square and invertible, and each column
    has ``L + 1`` non-zeros of magnitude 1: ``Delta_1 = log2(n) + 1``,
    ``Delta_2 = sqrt(log2(n) + 1)``. For other ``n`` the matrix of the next power of two is
    cut to the first ``n`` columns (still full column rank, because the columns of an
    invertible matrix are independent) and rows that became zero or duplicated (up to sign)
    are dropped, which never raises a column norm. Xiao, Wang & Gehrke (Privelet), ICDE 2010
    use weighted coefficients; this is the unweighted form whose errors HDMM publishes.
    """
    n = check_int(n, "n", minimum=1)
    size = 1 << (n - 1).bit_length()
    h = _haar_power_of_two(size)
    if size == n:
        return h
    h = h[:, :n]
    kept: list[np.ndarray] = []
    seen: set[bytes] = set()
    for row in h:
        if not np.any(row):
            continue
        first = row[np.flatnonzero(row)[0]]
        canonical = (row * np.sign(first)).tobytes()  # a row and its negative are the same
        if canonical in seen:
            continue
        seen.add(canonical)
        kept.append(row)
    return np.vstack(kept)


def prefix_strategy(n: int) -> np.ndarray:
    """Return the prefix strategy: row ``b`` is ``sum(x[0..b])`` (lower-triangular ones).

    Cell 0 is in every prefix: ``Delta_1 = n`` and ``Delta_2 = sqrt(n)``, so it rarely pays
    (it answers the prefix workload exactly, with every answer at the full noise scale).
    """
    n = check_int(n, "n", minimum=1)
    return np.tril(np.ones((n, n)))


# --------------------------------------------------------------------------- optimised strategies


@dataclass(frozen=True, eq=False)
class OptimizedStrategy:
    """The result of :func:`optimize_strategy`.

    Attributes
    ----------
    matrix : ndarray, shape (k, n)
        The strategy (largest column norm 1 in ``norm``); the identity when optimisation did
        not beat it.
    norm : {"l1", "l2"}
        Sensitivity norm it was optimised for (L1 for Laplace, L2 for Gaussian).
    template : {"p-identity", "convex", "marginals", "identity"}
        Which HDMM template won (:mod:`dpfed.common.queries.strategy_templates`).
    p : int
        Number of extra rows of the p-Identity template (0 for the others).
    squared_error : float
        ``Delta^2 ||W A^+||_F^2`` of ``matrix`` (total squared error at unit noise variance,
        ``Delta`` the replace-one :func:`sensitivity`).
    identity_squared_error : float
        The same for the identity strategy (``||W||_F^2`` times its ``Delta^2``).
    used_identity : bool
        True when no template improved on the identity, so ``matrix`` is the identity.
    restarts : int
        Number of random starts (per template that uses them).
    iterations : int
        L-BFGS-B iterations summed over starts and templates.
    seconds : float
        Wall-clock time spent optimising.
    timed_out : bool
        True when the time limit stopped a start early (its best point so far is used).
    """

    matrix: np.ndarray
    norm: str
    template: str
    p: int
    squared_error: float
    identity_squared_error: float
    used_identity: bool
    restarts: int
    iterations: int
    seconds: float
    timed_out: bool = False

    @property
    def improvement(self) -> float:
        """Per-query RMSE of the identity divided by that of ``matrix`` (>= 1)."""
        return math.sqrt(self.identity_squared_error / self.squared_error)


class _Deadline:
    """An L-BFGS-B callback that stops a start once the time limit has passed."""

    def __init__(self, until: float) -> None:
        self.until = until
        self.hit = False

    def __call__(self, intermediate_result: optimize.OptimizeResult) -> None:
        if time.perf_counter() > self.until:
            self.hit = True
            raise StopIteration


def _lbfgsb(loss: Any, start: np.ndarray, *, bounds: Any, maxiter: int,
            deadline: _Deadline) -> optimize.OptimizeResult:
    from scipy import optimize  # imported on first use: a slow import for every process

    return optimize.minimize(loss, start, jac=True, method="L-BFGS-B", bounds=bounds,
                             callback=deadline,
                             options={"maxiter": maxiter, "ftol": _OPTIMIZER_FTOL})


def _pidentity_candidate(gram: np.ndarray, diag: np.ndarray, p: int, norm: str,
                         restarts: int, maxiter: int, gen: np.random.Generator,
                         deadline: _Deadline) -> tuple[float, np.ndarray | None, int]:
    n = gram.shape[0]
    best_loss, best, iterations = math.inf, None, 0
    for _ in range(restarts):
        start = gen.random(p * n)  # HDMM initialises Theta uniformly in [0, 1)
        res = _lbfgsb(functools.partial(pidentity_loss, gram=gram, diag_gram=diag, p=p,
                                        norm=norm),
                      start, bounds=[(0.0, None)] * (p * n), maxiter=maxiter, deadline=deadline)
        iterations += int(res.nit)
        if float(res.fun) < best_loss:
            best_loss, best = float(res.fun), pidentity_matrix(np.asarray(res.x).reshape(p, n),
                                                                norm)
        if deadline.hit:
            break
    return best_loss, best, iterations


def _convex_candidate(gram: np.ndarray, maxiter: int,
                      deadline: _Deadline) -> tuple[float, np.ndarray | None, int]:
    programme = ConvexL2(gram)
    res = _lbfgsb(programme.loss, programme.start(), bounds=None, maxiter=maxiter,
                  deadline=deadline)
    if not math.isfinite(float(res.fun)):
        return math.inf, None, int(res.nit)
    return float(res.fun), programme.strategy(np.asarray(res.x)), int(res.nit)


def _marginals_candidate(algebra: MarginalAlgebra, target: np.ndarray, norm: str,
                         restarts: int, maxiter: int, gen: np.random.Generator,
                         deadline: _Deadline) -> tuple[float, np.ndarray | None, int]:
    """Run HDMM's marginals template, ``restarts`` uniform starts.

    L1: weights ``t``, Gram ``M(t^2)``, ``Delta = sum t``; L2: variances ``t``, Gram ``M(t)``,
    ``Delta^2 = sum t``; the loss is ``Delta^2 tr(M(w) Gram^-1)``.
    """

    def loss(t: np.ndarray) -> tuple[float, np.ndarray]:
        if norm == "l1":
            total = float(t.sum())
            value, grad = algebra.trace_loss(t * t, target)
            if not math.isfinite(value):
                return math.inf, np.zeros_like(t)
            return total * total * value, 2.0 * total * value + total * total * grad * 2.0 * t
        total = float(t.sum())
        value, grad = algebra.trace_loss(t, target)
        if not math.isfinite(value):
            return math.inf, np.zeros_like(t)
        return total * value, value + total * grad

    best_loss, best, iterations = math.inf, None, 0
    for _ in range(restarts):
        res = _lbfgsb(loss, gen.random(algebra.size), bounds=[(0.0, None)] * algebra.size,
                      maxiter=maxiter, deadline=deadline)
        iterations += int(res.nit)
        if float(res.fun) < best_loss:
            best_loss, best = float(res.fun), np.asarray(res.x)
        if deadline.hit:
            break
    if best is None:
        return math.inf, None, iterations
    weights = best if norm == "l1" else np.sqrt(best)
    if algebra.strategy_rows(weights) * algebra.n > MAX_STRATEGY_ENTRIES:
        return math.inf, None, iterations
    matrix = algebra.strategy(weights)
    return best_loss, matrix / column_norm(matrix, norm), iterations


def _marginal_algebra(w: Workload) -> tuple[MarginalAlgebra, np.ndarray] | None:
    """Return the workload as weighted marginals over its domain (None if it is not)."""
    if len(w.domain) < 2 or len(w.domain) > MAX_MARGINAL_ATTRIBUTES:
        return None
    algebra = MarginalAlgebra(tuple(w.domain))
    weights = algebra.weights_of(w.gram)
    return None if weights is None else (algebra, weights)


def optimize_strategy(workload: Workload | np.ndarray, *, noise: str = "laplace",
                      p: int | None = None, restarts: int = 3, maxiter: int = 1000,
                      rng: np.random.Generator | None = None,
                      time_limit: float = DEFAULT_TIME_LIMIT_S) -> OptimizedStrategy:
    """Optimise an HDMM strategy for a workload (McKenna et al., PVLDB 2018, ``OPT_0``).

    Templates (:mod:`dpfed.common.queries.strategy_templates`), each by L-BFGS-B with exact
    gradients, the best kept:

    * a workload made of weighted marginals (e.g. all 2-way marginals): HDMM's marginals
      template, ``restarts`` uniform starts;
    * Gaussian noise (L2), up to :data:`CONVEX_MAX_CELLS` cells: the convex programme over
      ``A^T A`` from HDMM's start -- the global optimum (all ranges over 256 cells: per-query
      RMSE 2.9014 at unit noise, HDMM's 2.902);
    * otherwise p-Identity ``A = [I; Theta] D``, ``restarts`` uniform starts.

    All optimise HDMM's column-norm proxy; the result is kept only if its replace-one error
    beats the identity's (else the identity is returned).

    Parameters
    ----------
    workload : Workload or array_like
        The workload; only its Gram matrix (and domain) is used.
    noise : {"laplace", "gaussian"}
        Which sensitivity norm to optimise for.
    p : int, optional
        Extra rows of p-Identity; default ``max(1, n // 16)`` as in HDMM.
    restarts : int
        Random starts (>= 1).
    maxiter : int
        L-BFGS-B iteration cap per start.
    rng : numpy.random.Generator, optional
        Source of the starting points. Default: a fixed seed, so that every party that runs
        the optimisation for the same workload gets the same (public) strategy.
    time_limit : float
        Wall-clock seconds after which the running start stops and the best point so far is
        used (a bound on planning at submit, not a quality target).

    Raises
    ------
    ValidationError
        The domain has more than :data:`MAX_OPTIMIZED_CELLS` cells (checked before any
        matrix is built), or an argument is invalid.

    Privacy
    -------
    None spent: the strategy depends only on the public workload, never on data.
    """
    check_choice(noise, "noise", NOISES)
    norm = _NOISE_NORM[noise]
    if isinstance(workload, Workload) and workload.n > MAX_OPTIMIZED_CELLS:
        raise ValidationError(
            f"the workload has {workload.n} cells; an optimised strategy is planned for at "
            f"most {MAX_OPTIMIZED_CELLS} (dense n x n work per optimiser step): use a named "
            "strategy (identity, h2, wavelet, prefix) or fewer bins")
    w = _as_workload(workload)
    n = w.n
    if n > MAX_OPTIMIZED_CELLS:
        raise ValidationError(f"the workload has {n} cells; an optimised strategy is planned "
                              f"for at most {MAX_OPTIMIZED_CELLS}")
    p = max(1, n // 16) if p is None else check_int(p, "p", minimum=1)
    restarts = check_int(restarts, "restarts", minimum=1)
    maxiter = check_int(maxiter, "maxiter", minimum=1)
    limit = check_positive(time_limit, "time_limit")
    gen = np.random.default_rng(_DEFAULT_OPTIMIZER_SEED) if rng is None else resolve_rng(rng)
    started = time.perf_counter()
    deadline = _Deadline(started + limit)
    # Scale the loss so the identity strategy scores 1: L-BFGS-B's tolerances are absolute.
    diag_gram = np.diag(w.gram).copy()
    identity_loss = float(diag_gram.sum())
    if identity_loss <= 0:
        raise ValidationError(f"workload {w.name!r} has no non-zero query")
    gram = w.gram / identity_loss
    candidates: list[tuple[float, str, np.ndarray]] = []
    iterations = 0
    marginals = _marginal_algebra(w)
    if marginals is not None:
        algebra, weights = marginals
        loss, matrix, its = _marginals_candidate(algebra, weights / identity_loss, norm,
                                                 restarts, maxiter, gen, deadline)
        iterations += its
        if matrix is not None:
            candidates.append((loss, "marginals", matrix))
    if norm == "l2" and n <= CONVEX_MAX_CELLS and not deadline.hit:
        loss, matrix, its = _convex_candidate(gram, maxiter, deadline)
        iterations += its
        if matrix is not None:
            candidates.append((loss, "convex", matrix))
    if not candidates and not deadline.hit:
        loss, matrix, its = _pidentity_candidate(gram, diag_gram / identity_loss, p, norm,
                                                 restarts, maxiter, gen, deadline)
        iterations += its
        if matrix is not None:
            candidates.append((loss, "p-identity", matrix))
    seconds = time.perf_counter() - started
    # Re-evaluate with the generic formula and the replace-one sensitivity, and keep the
    # winner only if it really beats the identity ("where it pays").
    identity_error = squared_error(w, np.eye(n), norm=norm)
    best: tuple[float, str, np.ndarray] | None = None
    for _, name, matrix in candidates:
        error = squared_error(w, matrix, norm=norm)
        if best is None or error < best[0]:
            best = (error, name, matrix)
    if best is not None and best[0] < identity_error:
        error, name, matrix = best
        logger.info("[matrix_mechanism.optimize_strategy] %s n=%d %s norm=%s: %.3gx better "
                    "than identity in %.2fs", w.name, n, name, norm,
                    math.sqrt(identity_error / error), seconds)
        return OptimizedStrategy(matrix, norm, name, p if name == "p-identity" else 0, error,
                                 identity_error, False, restarts, iterations, seconds,
                                 deadline.hit)
    logger.info("[matrix_mechanism.optimize_strategy] %s n=%d: no template beats identity; "
                "using identity", w.name, n)
    return OptimizedStrategy(np.eye(n), norm, "identity", 0, identity_error, identity_error,
                             True, restarts, iterations, seconds, deadline.hit)


def strategy(name: str, n: int, *, workload: Workload | np.ndarray | None = None,
             noise: str = "laplace", rng: np.random.Generator | None = None) -> np.ndarray:
    """Return the strategy matrix ``A`` (``k x n``) called ``name`` for ``n`` cells.

    Parameters
    ----------
    name : {"identity", "h2", "wavelet", "prefix", "optimized"}
        See :func:`identity_strategy`, :func:`h2_strategy`, :func:`wavelet_strategy`,
        :func:`prefix_strategy` and :func:`optimize_strategy`.
    n : int
        Number of histogram cells.
    workload : Workload or array_like, optional
        Required for ``"optimized"`` (and must have ``n`` cells); ignored by the others.
    noise : {"laplace", "gaussian"}
        For ``"optimized"``: which sensitivity (L1 or L2) to optimise for.
    rng : numpy.random.Generator, optional
        For ``"optimized"``: starting points (default: a fixed seed, see
        :func:`optimize_strategy`).
    """
    check_choice(name, "strategy name", STRATEGIES)
    n = check_int(n, "n", minimum=1)
    check_choice(noise, "noise", NOISES)
    if name == "optimized":
        if workload is None:
            raise ValidationError("strategy 'optimized' needs the workload to optimise for")
        w = _as_workload(workload, n)
        return optimize_strategy(w, noise=noise, rng=rng).matrix
    if workload is not None:
        _as_workload(workload, n)  # still catch a domain mismatch early
    if name == "identity":
        return identity_strategy(n)
    if name == "h2":
        return h2_strategy(n)
    if name == "wavelet":
        return wavelet_strategy(n)
    return prefix_strategy(n)


# --------------------------------------------------------------------------- the release


@dataclass(frozen=True, eq=False)
class MatrixMechanism:
    """Release ``A x + noise`` for a histogram ``x``: the site side of the matrix mechanism.

    Attributes
    ----------
    strategy_matrix : ndarray, shape (k, n)
        The public strategy ``A`` (stored read-only).
    epsilon : float
        Privacy parameter (> 0).
    delta : float or None
        Required (in (0, 1)) for Gaussian noise; must be None for Laplace.
    noise : {"laplace", "gaussian"}
        Noise distribution.
    sensitivity : float
        Replace-one sensitivity of ``A x``: ``max_{i != j} ||a_i - a_j||`` in L1 (Laplace) or
        L2 (Gaussian), or the bound twice the max column norm (:func:`sensitivity`).
    sensitivity_method : {"exact-pairs", "2x-max-column"}
        Which of the two ``sensitivity`` is.
    noise_scale : float
        Laplace scale ``b = Delta_1 / epsilon`` or Gaussian ``sigma``.
    noise_variance : float
        Variance of each noise entry: ``2 b^2`` or ``sigma^2``.

    Privacy
    -------
    Neighbouring relation: replace-one record of this site's data, the record count public
    (docs/privacy.md). ``x`` is a histogram of counts in which each record adds 1 to exactly
    one cell (its bin, from the public schema), so neighbours differ by ``e_j - e_i`` and
    ``A x`` by ``a_j - a_i``. Sensitivity: ``Delta_1 = max_{i != j} ||a_i - a_j||_1`` for
    Laplace, ``Delta_2 = max_{i != j} ||a_i - a_j||_2`` for Gaussian, or ``2 max_j ||a_j||``
    where the exact maximum is too costly (:func:`sensitivity`). Calibration: iid
    ``Lap(Delta_1 / epsilon)`` per entry gives epsilon-DP (seed 004; Li et al. 2010, Prop.
    4, with the replace-one sensitivity); iid ``N(0, sigma^2)`` with ``sigma =
    gaussian_sigma(epsilon, delta, Delta_2)`` (analytic, Balle & Wang 2018) gives
    (epsilon, delta)-DP (Li et al., VLDB J. 2015).
    Everything after the release (least squares, NNLS, L1, workload answers, summing sites)
    is post-processing. Floating-point grade noise (IEEE doubles).
    """

    strategy_matrix: np.ndarray
    epsilon: float
    delta: float | None = None
    noise: str = "laplace"
    sensitivity: float = field(init=False)
    noise_scale: float = field(init=False)
    noise_variance: float = field(init=False)
    sensitivity_method: str = field(init=False)

    def __post_init__(self) -> None:
        a = _check_strategy_matrix(self.strategy_matrix)
        noise, eps, delta = _check_noise(self.noise, self.epsilon, self.delta)
        a = a.copy()
        a.setflags(write=False)
        norm = _NOISE_NORM[noise]
        # Step 2: Delta_A, replace-one (max over column pairs, or the 2x column-norm bound).
        delta_a, method = sensitivity_with_method(a, norm)
        if delta_a == 0.0:
            raise ValidationError(
                "strategy_matrix has no two different columns, so A x depends only on the "
                "public row count (replace-one leaves it unchanged): there is nothing to "
                "release; use a strategy that tells at least two cells apart")
        if noise == "laplace":
            scale = delta_a / eps                             # seed: Lap(Delta_A / epsilon)
            variance = 2.0 * scale * scale
        else:
            assert delta is not None
            scale = gaussian_sigma(eps, delta, delta_a)      # analytic Gaussian
            variance = scale * scale
        for key, value in (("strategy_matrix", a), ("epsilon", eps), ("delta", delta),
                           ("noise", noise), ("sensitivity", delta_a), ("noise_scale", scale),
                           ("noise_variance", variance), ("sensitivity_method", method)):
            object.__setattr__(self, key, value)

    @property
    def n_cells(self) -> int:
        """Number of histogram cells ``n`` (columns of ``A``)."""
        return int(self.strategy_matrix.shape[1])

    def cost(self) -> PrivacyCost:
        """Return the privacy cost of one release (charge it before calling :meth:`release`)."""
        if self.noise == "laplace":
            return PrivacyCost.pure(self.epsilon, mechanism="matrix-laplace",
                                    sensitivity=self.sensitivity, noise_scale=self.noise_scale)
        assert self.delta is not None
        return PrivacyCost.gaussian(self.epsilon, self.delta, sigma=self.noise_scale,
                                    sensitivity=self.sensitivity, mechanism="matrix-gaussian")

    def release(self, x: Any, rng: np.random.Generator | None = None) -> np.ndarray:
        """Return ``A x + noise`` (length ``k``) for a histogram ``x`` of ``n`` counts.

        ``rng`` defaults to a fresh ``os.urandom``-seeded generator (production); tests pass
        a seeded one.
        """
        v = _check_histogram(x, self.n_cells)
        gen = resolve_rng(rng)
        answers = self.strategy_matrix @ v                     # step 1: strategy answers A x
        if self.noise == "laplace":
            noise = gen.laplace(0.0, self.noise_scale, size=answers.shape)
        else:
            noise = self.noise_scale * gen.standard_normal(size=answers.shape)
        logger.debug("[MatrixMechanism.release] noise=%s k=%d n=%d epsilon=%g",
                     self.noise, answers.shape[0], v.shape[0], self.epsilon)
        return np.asarray(answers + noise, dtype=np.float64)


def release(x: Any, strategy_matrix: Any, *, epsilon: float, delta: float | None = None,
            noise: str = "laplace", rng: np.random.Generator | None = None) -> np.ndarray:
    """Return the noisy strategy answers ``A x + noise`` (one site's release).

    Shorthand for ``MatrixMechanism(strategy_matrix, epsilon, delta, noise).release(x, rng)``;
    use the class when the cost must be charged to a ledger first.

    Privacy
    -------
    As :class:`MatrixMechanism`: replacing one record moves one count from cell ``i`` to
    cell ``j``, so the sensitivity of ``A x`` is ``max_{i != j} ||a_i - a_j||`` in L1
    (Laplace, epsilon-DP) or L2 (Gaussian, (epsilon, delta)-DP, analytic sigma), or twice the
    max column norm where that maximum is too costly (:func:`sensitivity`).
    """
    mech = MatrixMechanism(strategy_matrix, epsilon, delta, noise)
    return mech.release(x, rng)


# --------------------------------------------------------------------------- reconstruction


def _least_squares(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.asarray(np.linalg.lstsq(a, y, rcond=None)[0], dtype=np.float64)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy import optimize  # imported on first use: a slow import for every process

    n = a.shape[1]
    try:
        return np.asarray(optimize.nnls(a, y, maxiter=10 * n)[0], dtype=np.float64)
    except RuntimeError:
        # Lawson-Hanson hit its iteration cap: solve the same problem with bounded LSQ.
        res = optimize.lsq_linear(a, y, bounds=(0.0, np.inf), method="bvls")
        return np.maximum(np.asarray(res.x, dtype=np.float64), 0.0)


def _l1_nonnegative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Seed 004, section 1.4: ``argmin_{x >= 0} ||y - A x||_1`` as a linear programme.

    Variables ``[x, u, v] >= 0`` with ``A x + u - v = y``; minimise ``sum(u + v)``. At the
    optimum ``u - v`` is the residual and ``u + v`` its absolute value.
    """
    from scipy import optimize, sparse  # imported on first use (slow imports)

    k, n = a.shape
    eye = sparse.identity(k, format="csr")
    a_eq = sparse.hstack([sparse.csr_matrix(a), eye, -eye], format="csr")
    cost = np.concatenate([np.zeros(n), np.ones(2 * k)])
    res = optimize.linprog(cost, A_eq=a_eq, b_eq=y, bounds=(0.0, None), method="highs")
    if res.status != 0 or res.x is None:
        raise DpfedError(f"the L1 non-negative reconstruction failed: {res.message}")
    return np.maximum(np.asarray(res.x[:n], dtype=np.float64), 0.0)


def reconstruct(y: Any, strategy_matrix: Any, *, nonnegative: str | None = None) -> np.ndarray:
    """Estimate the histogram from noisy strategy answers ``y``.

    Parameters
    ----------
    y : array_like, shape (k,)
        Noisy answers ``A x + noise`` (one site's, or the sum over sites).
    strategy_matrix : array_like, shape (k, n)
        The strategy ``A`` the answers were released with.
    nonnegative : {None, "nnls", "l1"}
        ``None``: ordinary least squares ``x_hat = A^+ y`` (seed step 3; what HDMM does);
        unbiased when ``A`` has full column rank, and may be negative. ``"nnls"``:
        ``argmin_{x >= 0} ||y - A x||_2`` (scipy ``nnls``). When ``A`` has full column rank
        this is the projection of ``A^+ y`` onto ``x >= 0`` in the norm ``||A .||_2``, so it
        never moves further from the true (non-negative) ``x`` in that norm. ``"l1"``: the
        seed's ``argmin_{x >= 0} ||y - A x||_1`` (HiGHS linear programme), the
        non-negative maximum-likelihood estimate under iid Laplace noise.

    Notes
    -----
    Neither non-negative step is guaranteed to reduce the *workload* error, and both make the
    estimate biased, so :func:`expected_rmse` no longer applies. Measured on all ranges over
    a sparse histogram (``bench/matrix_mechanism.py``, n = 256, epsilon = 1): with H2 both
    cut the RMSE by 25-30%; with the identity strategy both equal clipping, whose positive
    bias on empty cells adds up along each range and raises the RMSE about 3.5x; with the
    square wavelet strategy NNLS helps (7-14%) but the L1 programme fits a subset of the
    rows exactly and is about 11x worse than least squares. Choose per strategy, or keep
    ``None``.

    Returns
    -------
    ndarray, shape (n,)
        The estimate ``x_hat``.

    Privacy
    -------
    Post-processing of a DP release: no budget spent, whatever the method.
    """
    a = _check_strategy_matrix(strategy_matrix)
    v = check_finite_array(y, "y", ndim=1)
    if v.shape[0] != a.shape[0]:
        raise ValidationError(f"y must have length {a.shape[0]} (rows of the strategy), "
                              f"got {v.shape[0]}")
    if nonnegative is None:
        return _least_squares(a, v)                            # step 3: x_hat = A^+ y
    check_choice(nonnegative, "nonnegative", NONNEGATIVE_METHODS)
    if nonnegative == "nnls":
        return _nnls(a, v)
    return _l1_nonnegative(a, v)                               # step 4: seed's L1 programme


def combine_releases(releases: Sequence[Any], strategy_matrix: Any, *,
                     nonnegative: str | None = None) -> np.ndarray:
    """Coordinator side: sum the sites' noisy ``A x_s + noise_s`` and reconstruct ``sum_s x_s``.

    Parameters
    ----------
    releases : sequence of array_like, each shape (k,)
        One release per site, all made with the same ``strategy_matrix``.
    strategy_matrix : array_like, shape (k, n)
        The shared strategy.
    nonnegative : {None, "nnls", "l1"}
        As in :func:`reconstruct`.

    Returns
    -------
    ndarray, shape (n,)
        Estimate of the pooled histogram ``sum_s x_s``.

    Privacy
    -------
    Post-processing only: the coordinator never sees an un-noised value. Each site spent its
    own epsilon (and delta) on its own disjoint records; a record influences one site's
    release only. The sum carries ``S`` independent noise vectors, so its noise variance is
    ``S`` times one site's: see ``n_sites`` in :func:`expected_rmse`.
    """
    a = _check_strategy_matrix(strategy_matrix)
    if isinstance(releases, np.ndarray) and releases.ndim == 1:
        raise ValidationError("releases must be a sequence of per-site vectors, got one vector")
    if len(releases) == 0:
        raise ValidationError("releases must contain at least one site's vector, got none")
    total = np.zeros(a.shape[0])
    for s, y in enumerate(releases):
        v = check_finite_array(y, f"releases[{s}]", ndim=1)
        if v.shape[0] != a.shape[0]:
            raise ValidationError(f"releases[{s}] must have length {a.shape[0]} (rows of the "
                                  f"strategy), got {v.shape[0]}")
        total += v
    return reconstruct(total, a, nonnegative=nonnegative)


def answer(workload: Workload | np.ndarray, x_hat: Any) -> np.ndarray:
    """Return the workload answers ``W x_hat`` (post-processing; see :meth:`Workload.answer`)."""
    return _as_workload(workload).answer(x_hat)


# --------------------------------------------------------------------------- expected error


def _gram_pinv_and_support(a: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """Return ``(A^T A)^+``, checking that ``A`` supports the workload (``W A^+ A = W``)."""
    ata = a.T @ a
    n = ata.shape[0]
    try:
        factor = linalg.cho_factor(ata)
        d = np.abs(np.diag(factor[0]))
        if d.min() > 1e-7 * d.max():  # well-conditioned: full column rank
            return np.asarray(linalg.cho_solve(factor, np.eye(n)), dtype=np.float64)
    except linalg.LinAlgError:
        pass
    vals, vecs = np.linalg.eigh(ata)
    keep = vals > 1e-10 * vals.max()
    null = vecs[:, ~keep]
    if null.size and np.linalg.norm(gram @ null) > 1e-8 * max(1.0, float(np.linalg.norm(gram))):
        raise ValidationError(
            "the strategy does not support the workload: some query is not a linear "
            "combination of strategy rows, so it cannot be estimated without bias"
        )
    kept = vecs[:, keep]
    return np.asarray((kept / vals[keep]) @ kept.T, dtype=np.float64)


def squared_error(workload: Workload | np.ndarray, strategy_matrix: Any, *,
                  norm: str | None = None) -> float:
    """Return ``||W A^+||_F^2 = tr((A^T A)^+ W^T W)``, times ``Delta^2`` if ``norm`` is given.

    Without ``norm`` this is the total squared error of least squares for unit-variance noise
    on ``A x``; with it, the strategy is first scaled to (replace-one) sensitivity 1 in that
    norm (:func:`sensitivity`), so strategies compare at the noise they really need. Only the
    Gram matrix of the workload is used.
    """
    a = _check_strategy_matrix(strategy_matrix)
    w = _as_workload(workload, a.shape[1])
    pinv = _gram_pinv_and_support(a, w.gram)
    total = float(np.sum(pinv * w.gram))  # tr(P G) for symmetric P, G
    if norm is not None:
        total *= sensitivity(a, norm) ** 2
    return total


def unit_noise_rmse(workload: Workload | np.ndarray, strategy_matrix: Any, *,
                    norm: str = "l2") -> float:
    """Per-query RMSE at unit noise: ``C * ||W A^+||_F / sqrt(m)`` (HDMM's normalisation).

    ``C`` is the largest column norm (:func:`column_norm`, the *add/remove* sensitivity of
    the papers). This is the figure HDMM's ``oned.csv`` tabulates (``norm="l2"``): the
    strategy scaled to column norm 1, noise of variance 1 per entry. Identity on all ranges
    over ``n`` cells gives ``sqrt((n + 2) / 3)`` (9.27 at ``n = 256``). It is for comparison
    with published figures only: a dpfed release pays the replace-one sensitivity
    (:func:`sensitivity`, up to 2x larger); :func:`expected_rmse` gives its real error.
    """
    check_choice(norm, "norm", NORMS)
    w = _as_workload(workload)
    a = _check_strategy_matrix(strategy_matrix)
    return math.sqrt(squared_error(w, a) * column_norm(a, norm) ** 2 / w.n_queries)


def noise_variance(strategy_matrix: Any, *, epsilon: float, delta: float | None = None,
                   noise: str = "laplace") -> float:
    """Return the variance of each noise entry: ``2 (Delta_1/epsilon)^2`` or ``sigma^2``."""
    return MatrixMechanism(strategy_matrix, epsilon, delta, noise).noise_variance


def expected_rmse(workload: Workload | np.ndarray, strategy_matrix: Any, *, epsilon: float,
                  delta: float | None = None, noise: str = "laplace", n_sites: int = 1) -> float:
    """Return the closed-form per-query RMSE of the matrix mechanism with least squares.

    ``sqrt(n_sites * Var * ||W A^+||_F^2 / m)`` with ``Var = 2 (Delta_1 / epsilon)^2``
    (Laplace) or ``sigma(epsilon, delta, Delta_2)^2`` (Gaussian), ``Delta`` the replace-one
    sensitivity the release itself uses (:attr:`MatrixMechanism.sensitivity`), and
    ``||W A^+||_F^2 = tr(A^+^T W^T W A^+)`` computed from the Gram matrix only (Li et al.
    2010, Prop. 7). Exact for the unbiased least-squares estimate; the non-negative steps
    change it in a data-dependent way.

    Parameters
    ----------
    workload : Workload or array_like
        The workload (``W`` or a :class:`~dpfed.common.queries.workloads.Workload`, possibly
        implicit).
    strategy_matrix : array_like, shape (k, n)
        The strategy; must support the workload.
    epsilon, delta, noise
        As in :class:`MatrixMechanism` (per site).
    n_sites : int
        Number of sites whose releases are summed by :func:`combine_releases`, each with the
        same epsilon and delta: the noise variance of the sum is ``n_sites`` times larger.
    """
    sites = check_int(n_sites, "n_sites", minimum=1)
    a = _check_strategy_matrix(strategy_matrix)
    var = noise_variance(a, epsilon=epsilon, delta=delta, noise=noise)
    w = _as_workload(workload, a.shape[1])
    return math.sqrt(sites * var * squared_error(w, a) / w.n_queries)


# --------------------------------------------------------------------------- choosing


@dataclass(frozen=True, eq=False)
class StrategyChoice:
    """The outcome of :func:`best_strategy`.

    Attributes
    ----------
    name : str
        Winning strategy name.
    noise : {"laplace", "gaussian"}
        Winning noise.
    matrix : ndarray
        The winning strategy matrix.
    rmse : float
        Its expected per-query RMSE.
    ranking : tuple of (str, str, float)
        Every (name, noise, rmse) tried, best first.
    """

    name: str
    noise: str
    matrix: np.ndarray
    rmse: float
    ranking: tuple[tuple[str, str, float], ...]


def best_strategy(workload: Workload | np.ndarray, *, epsilon: float,
                  delta: float | None = None, candidates: Sequence[str] = STRATEGIES,
                  noises: Sequence[str] | None = None, n_sites: int = 1,
                  rng: np.random.Generator | None = None) -> StrategyChoice:
    """Pick the strategy and noise with the smallest expected per-query RMSE.

    Parameters
    ----------
    workload : Workload or array_like
        The analyst's workload.
    epsilon, delta : float
        The per-site budget of the release. Without ``delta`` only Laplace is considered.
    candidates : sequence of str
        Strategy names (see :data:`STRATEGIES`).
    noises : sequence of str, optional
        Noises to consider; default both when ``delta`` is given, else Laplace only.
    n_sites : int
        Sites summed at the coordinator (scales every candidate equally).
    rng : numpy.random.Generator, optional
        Passed to the ``"optimized"`` candidate.

    Notes
    -----
    Laplace is pure epsilon-DP and Gaussian (epsilon, delta)-DP, so choosing Gaussian also
    spends ``delta``; the comparison is at the same nominal (epsilon, delta).
    """
    w = _as_workload(workload)
    eps = check_epsilon(epsilon)
    if noises is None:
        noises = NOISES if delta is not None else ("laplace",)
    noise_list = [check_choice(z, "noise", NOISES) for z in noises]
    names = [check_choice(c, "candidate", STRATEGIES) for c in candidates]
    if not names or not noise_list:
        raise ValidationError("best_strategy needs at least one candidate and one noise")
    scored: list[tuple[float, str, str, np.ndarray]] = []
    fixed: dict[str, np.ndarray] = {}
    for name in names:
        for z in noise_list:
            if name == "optimized":
                matrix = strategy(name, w.n, workload=w, noise=z, rng=rng)
            else:
                matrix = fixed.setdefault(name, strategy(name, w.n))
            rmse = expected_rmse(w, matrix, epsilon=eps, delta=delta if z == "gaussian" else None,
                                 noise=z, n_sites=n_sites)
            scored.append((rmse, name, z, matrix))
    scored.sort(key=lambda t: t[0])
    rmse, name, z, matrix = scored[0]
    ranking = tuple((nm, nz, r) for r, nm, nz, _ in scored)
    return StrategyChoice(name, z, matrix, rmse, ranking)
