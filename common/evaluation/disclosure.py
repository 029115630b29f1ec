"""Disclosure-risk metrics for masked or synthetic rows (seed 003 and its usual companions).

**These are evaluations, not DP releases.** Every function reads real rows, so it runs at a
site; its exact outputs stay there unless the operator shares them, never through the DP
release path or its ledger.

1. Seed 003: the distances ``d1`` (Mahalanobis), ``d2`` (scaled by each column's squared
   largest deviation), ``d3`` (their convex combination), the correlation-based
   re-identification probability ``P(j | a_i¹)`` and the scores ``M`` and ``M_best``.
2. Distance to closest record (DCR) against training rows and a holdout, and the
   nearest-neighbour distance ratio (NNDR), since the seed's authors call ``P`` weak.
Deviations from the seed, and how the blocked float32 searches stay exact:
docs/algorithms.md, "Disclosure metric".
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.spatial import cKDTree

from dpfed.common.errors import ValidationError
from dpfed.common.validation import (
    check_choice,
    check_finite_array,
    check_int,
    check_probability,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BLOCK_BYTES",
    "KDTREE_MAX_DIM",
    "MAX_BLOCK_BYTES_LIMIT",
    "CorrelationMatch",
    "DCRSummary",
    "DisclosureRisk",
    "MeanDistance",
    "NNDRSummary",
    "Neighbours",
    "correlation_match",
    "d1_squared",
    "d2_squared",
    "d3_squared",
    "dcr_summary",
    "disclosure_m",
    "disclosure_m_best",
    "disclosure_risk",
    "distance_to_closest_record",
    "nearest_neighbours",
    "neighbour_distance_ratio",
    "nndr",
    "nndr_summary",
    "standardize",
]

DEFAULT_MAX_BLOCK_BYTES = 4 * 2**20
MAX_BLOCK_BYTES_LIMIT = 256 * 2**20
KDTREE_MAX_DIM = 6
# Relative eigenvalue cut-off of the covariance pseudo-inverse: exact collinearity (one-hot
# blocks summing to 1) leaves eigenvalues ~1e-16 of the largest; genuine variance is far above.
_PINV_RCOND = 1e-10
_DEFAULT_RIDGE_FRACTION = 1e-6
_REF_BLOCK_MAX = 2048
_SINGULAR_CHOICES = ("pinv", "ridge")
_DISTANCE_CHOICES = ("d1", "d2", "d3")
_METHOD_CHOICES = ("auto", "blocked", "kdtree")
_PRECISION_CHOICES = ("float32", "float64")


# ---------------------------------------------------------------------------------- validation
def _matrix(data: Any, name: str, *, min_rows: int = 1) -> np.ndarray:
    """Return ``data`` as a finite float64 n×p array with at least ``min_rows`` rows."""
    a = check_finite_array(data, name, ndim=2)
    if a.shape[1] == 0:
        raise ValidationError(f"{name} must have at least one column, got shape {a.shape}")
    if a.shape[0] < min_rows:
        what = "must not be empty" if min_rows == 1 else f"needs at least {min_rows} rows"
        raise ValidationError(f"{name} {what}, got {a.shape[0]} row(s)")
    return a


def _same_width(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str) -> None:
    if a.shape[1] != b.shape[1]:
        raise ValidationError(
            f"{name_a} and {name_b} must have the same number of columns, "
            f"got {a.shape[1]} and {b.shape[1]}"
        )


def _block_bytes(value: Any) -> int:
    return check_int(value, "max_block_bytes", minimum=64, maximum=MAX_BLOCK_BYTES_LIMIT)


def _n_jobs(value: Any) -> int:
    return check_int(value, "n_jobs", minimum=1, maximum=256)


def _theta(theta: Any) -> float:
    return check_probability(theta, "theta", open_interval=True)


# ---------------------------------------------------------------- seed 003: distances (4)-(7)
@dataclass(frozen=True, eq=False)
class MeanDistance:
    """The seed's distances of rows from a mean, with the metric fitted on reference rows ``A``.

    Build it with :meth:`fit`. ``d1² = (a − c)ᵀ Σ⁺ (a − c)`` (eq. 4), ``d2² = (a − c)ᵀ M⁺ (a − c)``
    with ``M = diag(max_i |a_ij − ā_j|²)`` (eqs. 5-6), ``d3² = θ d1² + (1−θ) d2²`` (eq. 7 in its
    consistent squared form, see the module docstring). The centre ``c`` defaults to the
    reference mean ``ā``; the seed's ``M(A, A¹)`` uses the masked rows' own mean ``ā¹`` with the
    metric (Σ, M) of the original ``A``, as the authors' code does.

    Attributes
    ----------
    mean : ndarray, shape (p,)
        The reference mean ``ā``.
    whitening : ndarray, shape (p, k)
        ``W`` with ``W Wᵀ = Σ⁺`` (pinv: the k = rank eigenvectors scaled by ``λ^{-1/2}``) or
        ``(Σ + λ_r I)⁻¹`` (ridge: k = p), so ``d1² = ‖(a − c) W‖²``.
    max_deviation : ndarray, shape (p,)
        ``a^M_j = max_i |a_ij − ā_j|`` (eq. 3).
    covariance_rank : int
        Numerical rank of the sample covariance Σ (ddof = 1).
    singular : {"pinv", "ridge"}
        How Σ⁻¹ was formed (for a full-rank Σ, "pinv" is the plain inverse).
    ridge : float
        The ridge λ_r added to Σ (0.0 for "pinv").
    """

    mean: np.ndarray
    whitening: np.ndarray
    max_deviation: np.ndarray
    covariance_rank: int
    singular: str
    ridge: float

    @classmethod
    def fit(cls, reference: Any, *, singular: str = "pinv",
            ridge: float | None = None) -> MeanDistance:
        """Fit the metric on reference rows ``A`` (m×N, m >= 2).

        Parameters
        ----------
        reference : array_like, shape (m, N)
            The original rows.
        singular : {"pinv", "ridge"}
            ``"pinv"`` (default, as the seed's code): Moore–Penrose pseudo-inverse of Σ, i.e.
            distance measured only inside the span of the centred data; eigenvalues below
            ``1e-10 × λ_max`` count as zero. ``"ridge"``: ``(Σ + λ_r I)⁻¹``, which also charges
            movement off that span.
        ridge : float, optional
            λ_r for ``singular="ridge"``; default ``1e-6 × trace(Σ) / N``.

        Raises
        ------
        ValidationError
            Fewer than 2 rows, non-finite values, or every column constant.
        """
        a = _matrix(reference, "reference", min_rows=2)
        check_choice(singular, "singular", _SINGULAR_CHOICES)
        mean = a.mean(axis=0)
        centred = a - mean
        max_dev = np.abs(centred).max(axis=0)  # eq. (3)
        if not np.any(max_dev > 0):
            raise ValidationError("reference has zero variance in every column; "
                                  "the distances from the mean are undefined")
        cov = (centred.T @ centred) / (a.shape[0] - 1)
        eigval, eigvec = np.linalg.eigh(cov)
        eigval = np.clip(eigval, 0.0, None)
        rank = int(np.count_nonzero(eigval > _PINV_RCOND * eigval.max()))
        if singular == "pinv":
            # Deviation note: Σ is inverted only on its range (Σ⁺), as the authors' pinv.
            keep = eigval > _PINV_RCOND * eigval.max()
            whitening = eigvec[:, keep] / np.sqrt(eigval[keep])
            ridge_used = 0.0
        else:
            if ridge is None:
                ridge_used = _DEFAULT_RIDGE_FRACTION * float(np.trace(cov)) / cov.shape[0]
            else:
                ridge_used = float(ridge)
                if not math.isfinite(ridge_used) or ridge_used <= 0:
                    raise ValidationError(f"ridge must be finite and > 0, got {ridge!r}")
            whitening = eigvec / np.sqrt(eigval + ridge_used)
        if rank < a.shape[1]:
            logger.info("[MeanDistance.fit] covariance rank %d < %d columns; using %s",
                        rank, a.shape[1], singular)
        return cls(mean, np.ascontiguousarray(whitening), max_dev, rank, singular, ridge_used)

    @property
    def n_features(self) -> int:
        """Number of columns N."""
        return int(self.mean.shape[0])

    def _diff(self, rows: Any, center: Any) -> np.ndarray:
        x = _matrix(rows, "rows")
        if x.shape[1] != self.n_features:
            raise ValidationError(
                f"rows must have {self.n_features} columns like the reference, got {x.shape[1]}")
        if center is None:
            c = self.mean
        else:
            c = check_finite_array(center, "center", ndim=1)
            if c.shape[0] != self.n_features:
                raise ValidationError(
                    f"center must have {self.n_features} entries, got {c.shape[0]}")
        diff: np.ndarray = x - c
        return diff

    def d1_squared(self, rows: Any, center: Any = None) -> np.ndarray:
        """Eq. (4): squared Mahalanobis distance of each row from ``center`` (default ``ā``)."""
        z = self._diff(rows, center) @ self.whitening
        out: np.ndarray = np.einsum("ij,ij->i", z, z)
        return out

    def d2_squared(self, rows: Any, center: Any = None) -> np.ndarray:
        """Eqs. (5)-(6): ``Σ_j (a_j − c_j)² / (a^M_j)²``; zero-deviation columns contribute 0."""
        d = self._diff(rows, center)
        inv = np.zeros_like(self.max_deviation)
        nz = self.max_deviation > 0
        inv[nz] = 1.0 / self.max_deviation[nz] ** 2  # M⁺ (guard for constant columns)
        out: np.ndarray = (d * d) @ inv
        return out

    def d3_squared(self, rows: Any, theta: float, center: Any = None) -> np.ndarray:
        """Eq. (7), consistent form: ``θ d1² + (1−θ) d2²`` with θ in (0, 1)."""
        t = _theta(theta)
        out: np.ndarray = t * self.d1_squared(rows, center) + (1.0 - t) * self.d2_squared(
            rows, center)
        return out

    def squared(self, rows: Any, distance: str = "d1", *, theta: float = 0.5,
                center: Any = None) -> np.ndarray:
        """Squared distance ``distance`` in {"d1", "d2", "d3"} of each row from ``center``."""
        check_choice(distance, "distance", _DISTANCE_CHOICES)
        if distance == "d1":
            return self.d1_squared(rows, center)
        if distance == "d2":
            return self.d2_squared(rows, center)
        return self.d3_squared(rows, theta, center)


def d1_squared(data: Any, *, singular: str = "pinv") -> np.ndarray:
    """Squared Mahalanobis distance of each row of ``data`` from its own mean (seed eq. 4).

    Σ is the sample covariance (ddof = 1); a singular Σ uses its pseudo-inverse (or a ridge with
    ``singular="ridge"``), see :meth:`MeanDistance.fit`.
    """
    return MeanDistance.fit(data, singular=singular).d1_squared(data)


def d2_squared(data: Any) -> np.ndarray:
    """Squared max-deviation distance of each row of ``data`` from its own mean (eqs. 5-6)."""
    return MeanDistance.fit(data).d2_squared(data)


def d3_squared(data: Any, theta: float, *, singular: str = "pinv") -> np.ndarray:
    """``θ d1² + (1−θ) d2²`` for each row of ``data`` (eq. 7, consistent squared form)."""
    return MeanDistance.fit(data, singular=singular).d3_squared(data, theta)


# ------------------------------------------------------------------------ blocked search core
def _block_shape(n_query: int, n_ref: int, itemsize: int, max_block_bytes: int) -> tuple[int, int]:
    """Rows and columns of one score block so that rows × cols × itemsize <= max_block_bytes."""
    cols = max(1, min(n_ref, _REF_BLOCK_MAX, max_block_bytes // itemsize))
    rows = max(1, min(n_query, max_block_bytes // (cols * itemsize)))
    return rows, cols


BlockHook = Callable[[np.ndarray, int, int], None]


class _BlasThreadLimit:
    """Run OpenBLAS single-threaded while any blocked search is active (restored afterwards).

    Each block product is small (a few hundred query rows × ≤ 2048 reference rows × p + 1), so
    OpenBLAS's own threads only add synchronisation; on a shared machine their spin-waits made
    the search 4-5× slower (bench/metrics_speed.py). Parallelism comes instead from ``n_jobs``
    worker threads over query rows (numpy releases the GIL in BLAS calls and reductions).
    The thread count is process-wide in OpenBLAS's pthreads build: other BLAS calls in the
    process also run on one thread while a search is active, and a depth counter restores the
    saved count only when the last concurrent search ends. The functions are found the way
    threadpoolctl finds them: every loaded ``*openblas*.so`` (Linux ``/proc/self/maps``), symbol
    ``[scipy_]openblas_{get,set}_num_threads[64_]``. Elsewhere, or with another BLAS, this is a
    no-op and the BLAS keeps its own setting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list[int] = []
        self._controls: list[tuple[Any, Any]] | None = None

    def _find(self) -> list[tuple[Any, Any]]:
        if self._controls is not None:
            return self._controls
        controls: list[tuple[Any, Any]] = []
        try:
            with open("/proc/self/maps", encoding="utf-8") as maps:
                paths = sorted({line.split()[-1] for line in maps
                                if "openblas" in line.rsplit("/", 1)[-1] and ".so" in line})
        except OSError:
            paths = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LOCAL)
            except OSError:
                continue
            for prefix, suffix in (("", ""), ("scipy_", "64_"), ("scipy_", ""), ("", "64_")):
                get = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    put.restype, put.argtypes = None, [ctypes.c_int]
                    controls.append((get, put))
                    break
        self._controls = controls
        return controls

    def threads(self) -> list[int]:
        """Return the thread counts of the OpenBLAS libraries found (empty if none)."""
        with self._lock:
            return [int(get()) for get, _ in self._find()]

    @contextlib.contextmanager
    def single(self) -> Iterator[None]:
        """Context in which every OpenBLAS found runs on one thread."""
        with self._lock:
            controls = self._find()
            if self._depth == 0:
                self._saved = [int(get()) for get, _ in controls]
                for _, put in controls:
                    put(1)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for (_, put), n in zip(controls, self._saved, strict=True):
                        put(n)


_BLAS_THREADS = _BlasThreadLimit()


def _topk_rows(query_aug: np.ndarray, ref_t: list[np.ndarray], k: int, start: int, stop: int,
               best_val: np.ndarray, best_idx: np.ndarray, *, exclude_self: bool, rows: int,
               cols: int, hook: BlockHook | None) -> None:
    """Fill ``best_val/best_idx[start:stop]`` with the top-k of query rows start..stop-1."""
    dtype = query_aug.dtype
    buf = np.empty(rows * cols, dtype=dtype)  # the only block-sized allocation of this worker
    cand_val = np.empty((rows, 2 * k), dtype=dtype)
    cand_idx = np.empty((rows, 2 * k), dtype=np.int64)
    for i0 in range(start, stop, rows):
        q = query_aug[i0:min(i0 + rows, stop)]
        nb = q.shape[0]
        r = np.arange(nb)
        cv, ci = cand_val[:nb], cand_idx[:nb]
        cv[:, :k] = np.inf
        ci[:, :k] = 0
        j0 = 0
        for rt in ref_t:
            mb = rt.shape[1]
            block = buf[:nb * mb].reshape(nb, mb)
            np.matmul(q, rt, out=block)  # one BLAS call: the scores of nb × mb pairs
            if hook is not None:
                hook(block, i0, j0)
            if exclude_self:
                # Query row i0 + t is reference row i0 + t: never its own neighbour.
                t = np.arange(max(i0, j0), min(i0 + nb, j0 + mb))
                block[t - i0, t - j0] = np.inf
            # Block top-k by repeated argmin + mask (k is small, each pass is SIMD).
            for s in range(k):
                idx = block.argmin(axis=1)
                cv[:, k + s] = block[r, idx]
                ci[:, k + s] = idx + j0
                if s + 1 < k:
                    block[r, idx] = np.inf
            # Merge the running top-k with this block's top-k.
            order = np.argsort(cv, axis=1, kind="stable")[:, :k]
            cv[:, :k] = np.take_along_axis(cv, order, axis=1)
            ci[:, :k] = np.take_along_axis(ci, order, axis=1)
            j0 += mb
        best_val[i0:i0 + nb] = cv[:, :k]
        best_idx[i0:i0 + nb] = ci[:, :k]


def _blocked_topk(query_aug: np.ndarray, ref_aug: np.ndarray, k: int, *, exclude_self: bool,
                  max_block_bytes: int, n_jobs: int = 1, hook: BlockHook | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Keep the running top-k (smallest) of ``S = query_aug @ ref_augᵀ`` per query row.

    ``hook(block, i0, j0)`` may read and modify each block in place before the reduction (used to
    accumulate row sums; with ``n_jobs > 1`` it runs in several threads on disjoint rows).
    Memory: ``n_jobs`` blocks of at most ``max_block_bytes`` each plus O((n + m)(p + k)).
    Returns (scores n×k in the working dtype, reference indices n×k), sorted ascending.
    """
    n, m = query_aug.shape[0], ref_aug.shape[0]
    rows, cols = _block_shape(n, m, query_aug.dtype.itemsize, max_block_bytes)
    best_val = np.empty((n, k), dtype=query_aug.dtype)
    best_idx = np.empty((n, k), dtype=np.int64)
    ref_t = [np.ascontiguousarray(ref_aug[j0:j0 + cols].T) for j0 in range(0, m, cols)]
    # Contiguous query ranges, one per worker, aligned to whole blocks.
    n_blocks = -(-n // rows)
    per_worker = -(-n_blocks // max(1, min(n_jobs, n_blocks))) * rows
    ranges = [(a, min(a + per_worker, n)) for a in range(0, n, per_worker)]
    with _BLAS_THREADS.single():
        if len(ranges) == 1:
            _topk_rows(query_aug, ref_t, k, 0, n, best_val, best_idx, exclude_self=exclude_self,
                       rows=rows, cols=cols, hook=hook)
        else:
            with ThreadPoolExecutor(max_workers=len(ranges)) as pool:
                futures = [pool.submit(_topk_rows, query_aug, ref_t, k, a, b, best_val,
                                       best_idx, exclude_self=exclude_self, rows=rows,
                                       cols=cols, hook=hook) for a, b in ranges]
                for future in futures:
                    future.result()
    return best_val, best_idx


def _row_chunk(n_cols: int, k: int) -> int:
    """Rows per chunk for O(n k p) float64 temporaries of about 32 MiB."""
    return max(1, (32 * 2**20) // (8 * max(1, n_cols) * max(1, k)))


def _exact_sq_distances(query: np.ndarray, reference: np.ndarray,
                        idx: np.ndarray) -> np.ndarray:
    """Exact float64 ``‖q_i − r_idx[i, s]‖²`` from row differences, chunked over rows."""
    n, k = idx.shape
    out = np.empty((n, k), dtype=np.float64)
    step = _row_chunk(query.shape[1], k)
    for i0 in range(0, n, step):
        diff = query[i0:i0 + step, None, :] - reference[idx[i0:i0 + step]]
        out[i0:i0 + step] = np.einsum("ijk,ijk->ij", diff, diff)
    return out


# ------------------------------------------------------------------------- nearest neighbours
@dataclass(frozen=True, eq=False)
class Neighbours:
    """The k nearest reference rows of each query row (Euclidean), nearest first.

    Attributes
    ----------
    distances : ndarray, shape (n, k), float64
        Euclidean distances, ascending per row (exact float64 recomputation).
    indices : ndarray, shape (n, k), int64
        Row indices into the reference.
    method : str
        "blocked" or "kdtree" (what ``method="auto"`` chose).
    """

    distances: np.ndarray
    indices: np.ndarray
    method: str


def nearest_neighbours(query: Any, reference: Any, *, k: int = 2, exclude_self: bool = False,
                       method: str = "auto", precision: str = "float32",
                       max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                       n_jobs: int = 1) -> Neighbours:
    """Find the ``k`` nearest reference rows of every query row without an n×m matrix.

    Parameters
    ----------
    query : array_like, shape (n, p)
    reference : array_like, shape (m, p)
        Needs at least ``k`` rows (``k + 1`` with ``exclude_self``).
    k : int
        Number of neighbours, 1..16.
    exclude_self : bool
        Query and reference are the same rows: query row i never matches reference row i (its
        exact duplicates still do). Requires equal shapes.
    method : {"auto", "blocked", "kdtree"}
        ``"blocked"``: chunked BLAS with a running top-k. ``"kdtree"``: scipy's cKDTree (exact,
        fast only in low dimension). ``"auto"``: kdtree when ``p <= KDTREE_MAX_DIM``.
    precision : {"float32", "float64"}
        Working precision of the blocked search; the returned distances are always recomputed
        in float64 from the row differences.
    max_block_bytes : int
        Memory bound of one score block (64 B .. 256 MiB; default 4 MiB).
    n_jobs : int
        Worker threads of the blocked search (each holds one block; OpenBLAS runs
        single-threaded meanwhile, see :class:`_BlasThreadLimit`). The kd-tree uses them too.

    Returns
    -------
    Neighbours
    """
    q = _matrix(query, "query")
    ref = _matrix(reference, "reference")
    _same_width(q, ref, "query", "reference")
    k = check_int(k, "k", minimum=1, maximum=16)
    check_choice(method, "method", _METHOD_CHOICES)
    check_choice(precision, "precision", _PRECISION_CHOICES)
    block_bytes = _block_bytes(max_block_bytes)
    jobs = _n_jobs(n_jobs)
    need = k + 1 if exclude_self else k
    if ref.shape[0] < need:
        raise ValidationError(
            f"reference needs at least {need} rows for k={k}"
            f"{' with exclude_self' if exclude_self else ''}, got {ref.shape[0]}")
    if exclude_self and q.shape != ref.shape:
        raise ValidationError(
            f"exclude_self needs query and reference to be the same rows, "
            f"got shapes {q.shape} and {ref.shape}")
    if method == "auto":
        method = "kdtree" if q.shape[1] <= KDTREE_MAX_DIM else "blocked"
    logger.debug("[disclosure.nearest_neighbours] query %s reference %s k=%d method=%s",
                 q.shape, ref.shape, k, method)
    if method == "kdtree":
        tree = cKDTree(ref)
        dist, idx = tree.query(q, k=need, workers=jobs)
        dist = np.asarray(dist, dtype=np.float64).reshape(q.shape[0], need)
        idx = np.asarray(idx, dtype=np.int64).reshape(q.shape[0], need)
        if exclude_self:
            # Drop the self entry if returned, else the farthest (then all ties are at 0).
            is_self = idx == np.arange(q.shape[0])[:, None]
            is_self[~is_self.any(axis=1), -1] = True
            order = np.argsort(is_self, axis=1, kind="stable")[:, :k]
            dist = np.take_along_axis(dist, order, axis=1)
            idx = np.take_along_axis(idx, order, axis=1)
        return Neighbours(np.ascontiguousarray(dist), np.ascontiguousarray(idx), "kdtree")
    dtype = np.float32 if precision == "float32" else np.float64
    # Centre at the reference mean: distances are unchanged, cancellation in ‖r‖² − 2q·r is less.
    shift = ref.mean(axis=0)
    rc = ref - shift
    qc = q - shift
    query_aug = np.empty((q.shape[0], q.shape[1] + 1), dtype=dtype)
    query_aug[:, :-1] = -2.0 * qc
    query_aug[:, -1] = 1.0
    ref_aug = np.empty((ref.shape[0], ref.shape[1] + 1), dtype=dtype)
    ref_aug[:, :-1] = rc
    ref_aug[:, -1] = np.einsum("ij,ij->i", rc, rc)
    _, idx = _blocked_topk(query_aug, ref_aug, k, exclude_self=exclude_self,
                           max_block_bytes=block_bytes, n_jobs=jobs)
    # Refinement: exact float64 distances of the winners, re-sorted.
    sq = _exact_sq_distances(q, ref, idx)
    order = np.argsort(sq, axis=1, kind="stable")
    sq = np.take_along_axis(sq, order, axis=1)
    idx = np.take_along_axis(idx, order, axis=1)
    return Neighbours(np.sqrt(sq), idx, "blocked")


def standardize(reference: Any, *others: Any) -> tuple[np.ndarray, ...]:
    """z-score ``reference`` and ``others`` with the reference's column means and stds (ddof 0).

    Columns constant in the reference are only centred (std taken as 1). Returns the arrays in
    the order given, reference first.
    """
    ref = _matrix(reference, "reference")
    mean = ref.mean(axis=0)
    std = ref.std(axis=0)
    std[std == 0] = 1.0
    out = [(ref - mean) / std]
    for i, other in enumerate(others):
        o = _matrix(other, f"others[{i}]")
        _same_width(ref, o, "reference", f"others[{i}]")
        out.append((o - mean) / std)
    return tuple(out)


# ----------------------------------------------------------------------------------- DCR
def distance_to_closest_record(query: Any, reference: Any, **options: Any) -> np.ndarray:
    """Euclidean distance from each query row to its closest reference row (DCR).

    ``options`` are passed to :func:`nearest_neighbours` (``method``, ``precision``,
    ``max_block_bytes``, ``exclude_self``). Standardise the columns first (see
    :func:`standardize`); exact copies give 0.0.
    """
    return nearest_neighbours(query, reference, k=1, **options).distances[:, 0].copy()


@dataclass(frozen=True)
class DCRSummary:
    """Distance-to-closest-record figures of synthetic rows (SDV DCR-overfitting style).

    Attributes
    ----------
    n_synthetic, n_train, n_holdout : int
        Row counts (``n_holdout`` 0 when no holdout was given).
    train_median, train_p5 : float
        Median and 5th percentile of the synthetic→train DCR.
    exact_copy_share : float
        Share of synthetic rows identical to some training row (DCR == 0).
    holdout_median, holdout_p5 : float or None
        The same for synthetic→holdout DCR.
    share_closer_to_train : float or None
        Share of synthetic rows strictly closer to train than to holdout (ties count ½).
    expected_share : float or None
        ``n_train / (n_train + n_holdout)``: the share expected when synthetic rows are fresh
        draws from the population (the closest of the pooled real rows is then equally likely
        to be any of them). Well above it means the generator memorised training rows.
    holdout_to_train_p5 : float or None
        5th percentile of holdout→train DCR: how close a genuinely new record typically gets.
    share_below_holdout_p5 : float or None
        Share of synthetic rows whose train DCR is below ``holdout_to_train_p5``
        (about 0.05 when synthetic rows behave like new records; the SynthesizerPlus rule with
        a holdout baseline instead of the real-to-real one).
    """

    n_synthetic: int
    n_train: int
    n_holdout: int
    train_median: float
    train_p5: float
    exact_copy_share: float
    holdout_median: float | None = None
    holdout_p5: float | None = None
    share_closer_to_train: float | None = None
    expected_share: float | None = None
    holdout_to_train_p5: float | None = None
    share_below_holdout_p5: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (floats, ints, None)."""
        return asdict(self)

    @classmethod
    def from_distances(cls, train_dcr: np.ndarray, n_train: int, *,
                       holdout_dcr: np.ndarray | None = None,
                       holdout_to_train_dcr: np.ndarray | None = None) -> DCRSummary:
        """Summarise DCR arrays: synthetic→train, synthetic→holdout and holdout→train.

        ``holdout_dcr`` and ``holdout_to_train_dcr`` go together (both or neither); the
        holdout size is the length of ``holdout_to_train_dcr``.
        """
        fields: dict[str, Any] = {
            "n_synthetic": int(train_dcr.shape[0]), "n_train": int(n_train), "n_holdout": 0,
            "train_median": float(np.median(train_dcr)),
            "train_p5": float(np.percentile(train_dcr, 5)),
            "exact_copy_share": float(np.mean(train_dcr == 0.0)),
        }
        if (holdout_dcr is None) != (holdout_to_train_dcr is None):
            raise ValidationError("holdout_dcr and holdout_to_train_dcr must be given together")
        if holdout_dcr is not None and holdout_to_train_dcr is not None:
            if holdout_dcr.shape != train_dcr.shape:
                raise ValidationError(
                    f"holdout_dcr must have one entry per synthetic row ({train_dcr.shape[0]}), "
                    f"got {holdout_dcr.shape[0]}")
            n_holdout = int(holdout_to_train_dcr.shape[0])
            base_p5 = float(np.percentile(holdout_to_train_dcr, 5))
            # Ties (equally close to both) count one half.
            closer = np.where(train_dcr < holdout_dcr, 1.0,
                              np.where(train_dcr == holdout_dcr, 0.5, 0.0))
            fields.update(
                n_holdout=n_holdout,
                holdout_median=float(np.median(holdout_dcr)),
                holdout_p5=float(np.percentile(holdout_dcr, 5)),
                share_closer_to_train=float(closer.mean()),
                expected_share=n_train / (n_train + n_holdout),
                holdout_to_train_p5=base_p5,
                share_below_holdout_p5=float(np.mean(train_dcr < base_p5)),
            )
        return cls(**fields)


def dcr_summary(synthetic: Any, train: Any, *, holdout: Any = None,
                **options: Any) -> DCRSummary:
    """DCR of synthetic rows against the training rows and, if given, a holdout.

    Parameters
    ----------
    synthetic, train : array_like, shape (n, p) and (m, p)
        Already on a common, standardised scale (e.g. :func:`standardize` with the train rows
        as reference).
    holdout : array_like, shape (h, p), optional
        Real rows from the same population that the generator never saw.
    **options
        Passed to :func:`nearest_neighbours`.
    """
    syn = _matrix(synthetic, "synthetic")
    tr = _matrix(train, "train")
    _same_width(tr, syn, "train", "synthetic")
    d_train = distance_to_closest_record(syn, tr, **options)
    if holdout is None:
        return DCRSummary.from_distances(d_train, tr.shape[0])
    ho = _matrix(holdout, "holdout")
    _same_width(tr, ho, "train", "holdout")
    return DCRSummary.from_distances(
        d_train, tr.shape[0],
        holdout_dcr=distance_to_closest_record(syn, ho, **options),
        holdout_to_train_dcr=distance_to_closest_record(ho, tr, **options),
    )


# ---------------------------------------------------------------------------------- NNDR
def nndr(synthetic: Any, real: Any, **options: Any) -> np.ndarray:
    """Nearest-neighbour distance ratio of each synthetic row against the real rows.

    ``d(nearest real) / d(second-nearest real)`` in [0, 1]; small values mean the synthetic row
    singles out one real record. ``0/0`` (the row copies two or more identical real rows) is
    taken as 0, the conservative reading. Use standardised columns (:func:`standardize`).
    ``options`` go to :func:`nearest_neighbours`.
    """
    return neighbour_distance_ratio(nearest_neighbours(synthetic, real, k=2, **options))


def neighbour_distance_ratio(neighbours: Neighbours) -> np.ndarray:
    """NNDR from a k >= 2 :class:`Neighbours` result (``0/0`` taken as 0, see :func:`nndr`)."""
    if neighbours.distances.shape[1] < 2:
        raise ValidationError(
            f"NNDR needs k >= 2 neighbours, got k={neighbours.distances.shape[1]}")
    first, second = neighbours.distances[:, 0], neighbours.distances[:, 1]
    ratio = np.zeros_like(first)
    pos = second > 0
    ratio[pos] = first[pos] / second[pos]
    return ratio


@dataclass(frozen=True)
class NNDRSummary:
    """Summary of NNDR values: ``share_above_half`` is rsdv's score (higher is more private)."""

    n_synthetic: int
    mean: float
    median: float
    p5: float
    share_above_half: float

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return asdict(self)

    @classmethod
    def from_ratios(cls, ratio: np.ndarray) -> NNDRSummary:
        """Summarise an array of NNDR values."""
        if ratio.size == 0:
            raise ValidationError("ratio must not be empty")
        return cls(
            n_synthetic=int(ratio.shape[0]),
            mean=float(ratio.mean()),
            median=float(np.median(ratio)),
            p5=float(np.percentile(ratio, 5)),
            share_above_half=float(np.mean(ratio > 0.5)),
        )


def nndr_summary(synthetic: Any, real: Any, **options: Any) -> NNDRSummary:
    """Mean, median, 5th percentile of :func:`nndr` and the share of ratios above 0.5."""
    return NNDRSummary.from_ratios(nndr(synthetic, real, **options))


# ------------------------------------------------------- seed 003: probability (10)-(12)
@dataclass(frozen=True, eq=False)
class CorrelationMatch:
    """Per masked row: the seed's correlation-based probability and its ingredients.

    Attributes
    ----------
    probability : ndarray, shape (n,)
        ``P_i = max_j C_ij − mean_{j ≠ argmax} C_ij`` (eqs. 11-12), clipped to [0, 1].
    best_match : ndarray, shape (n,), int64
        ``argmax_j C_ij``: the original row an attacker would link masked row i to.
    max_cosine : ndarray, shape (n,)
        ``max_j C_ij`` (exact float64).
    mean_other_cosine : ndarray, shape (n,)
        ``C̃_i``, the mean of the other m − 1 cosines (eq. 11).
    absolute : bool
        Whether ``|cos|`` (the authors' code) or the signed cosine (default) was used.
    """

    probability: np.ndarray
    best_match: np.ndarray
    max_cosine: np.ndarray
    mean_other_cosine: np.ndarray
    absolute: bool


def _unit_rows(centred: np.ndarray) -> np.ndarray:
    """Rows divided by their norm; rows of norm 0 (exactly at the mean) stay 0 (cosine 0)."""
    norms = np.sqrt(np.einsum("ij,ij->i", centred, centred))
    out = np.zeros_like(centred)
    nz = norms > 0
    out[nz] = centred[nz] / norms[nz, None]
    return out


def correlation_match(original: Any, masked: Any, *, absolute: bool = False,
                      precision: str = "float32",
                      max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                      n_jobs: int = 1) -> CorrelationMatch:
    """Compute the seed's re-identification probability ``P(j | a_i¹)`` for every masked row.

    ``C_ij = (a_j − ā)ᵀ(a_i¹ − ā¹) / (‖a_j − ā‖ ‖a_i¹ − ā¹‖)`` -- eq. (10) with the product of
    norms in the denominator (the seed's denominator is the norm of the numerator, a typo).
    ``P_i = max_j C_ij − (Σ_j C_ij − max_j C_ij)/(m − 1)`` (eqs. 11-12).

    The max runs as a blocked search (the same kernel as :func:`nearest_neighbours`); the sum is
    exact for the signed cosine (``Σ_j C_ij = v_iᵀ Σ_j u_j`` with unit rows u, v) and accumulated
    block by block in float64 for ``absolute=True``. The winning cosine is recomputed in
    float64, so an exact copy gives ``max_cosine == 1`` up to rounding.

    Parameters
    ----------
    original : array_like, shape (m, N), m >= 2
    masked : array_like, shape (n, N)
        Any number of rows (row alignment is not needed).
    absolute : bool
        Use ``|C_ij|`` as the authors' code does (see the module docstring for why the signed
        cosine is the default).
    precision, max_block_bytes, n_jobs
        As in :func:`nearest_neighbours`.
    """
    a = _matrix(original, "original", min_rows=2)
    b = _matrix(masked, "masked")
    _same_width(a, b, "original", "masked")
    check_choice(precision, "precision", _PRECISION_CHOICES)
    block_bytes = _block_bytes(max_block_bytes)
    jobs = _n_jobs(n_jobs)
    u = _unit_rows(a - a.mean(axis=0))
    v = _unit_rows(b - b.mean(axis=0))
    dtype = np.float32 if precision == "float32" else np.float64
    m = a.shape[0]
    hook: BlockHook | None = None
    if absolute:
        abs_sum = np.zeros(b.shape[0], dtype=np.float64)

        def _abs_hook(block: np.ndarray, i0: int, j0: int) -> None:
            # block holds −C; the authors' |C|: accumulate Σ_j |C_ij|, then search −|C|.
            np.abs(block, out=block)
            abs_sum[i0:i0 + block.shape[0]] += block.sum(axis=1, dtype=np.float64)
            np.negative(block, out=block)

        hook = _abs_hook

    # Search the smallest −C_ij (or −|C_ij|), i.e. the largest cosine.
    _, idx = _blocked_topk(np.asarray(-v, dtype=dtype), np.asarray(u, dtype=dtype), 1,
                           exclude_self=False, max_block_bytes=block_bytes, n_jobs=jobs,
                           hook=hook)
    best = idx[:, 0]
    max_cos = np.einsum("ij,ij->i", v, u[best])  # exact float64 refinement
    if absolute:
        max_cos = np.abs(max_cos)
        total = abs_sum
    else:
        total = v @ u.sum(axis=0)  # Σ_j C_ij exactly
    mean_other = (total - max_cos) / (m - 1)  # eq. (11)
    prob = np.clip(max_cos - mean_other, 0.0, 1.0)  # eq. (12), clipped to a probability
    return CorrelationMatch(prob, best, max_cos, mean_other, absolute)


# -------------------------------------------------------------- seed 003: M and M_best (8)-(13)
@dataclass(frozen=True)
class DisclosureRisk:
    """The seed's scores of masked rows against the original rows.

    ``m = Σ_i d(a_i¹, ā¹)² (1 − P_i)`` (eq. 8) with the chosen distance, ``m_best =
    Σ_i d1(a_i¹, ā¹)² (1 − P_i)²`` (eq. 13, the authors' best finding). Near 0: an attacker can
    link masked rows to original rows; larger is more private. The metric (Σ, M) is fitted on
    the original rows and the masked rows are measured from their own mean ``ā¹``, as the
    authors' code does. ``*_per_row`` divide by the number of masked rows.

    Caveat (the authors' own "very high probability, every time"): with few columns and many
    original rows, some original row points almost the same way as *any* masked row, so
    ``max_j C_ij → 1``, ``P → 1`` and ``M → 0`` even for synthetic rows drawn independently of
    the originals (measured: mean P = 0.997 for an independent 20k-row table with 6 features).
    Read ``M`` together with DCR and NNDR, which do not saturate this way.
    """

    m: float
    m_best: float
    m_per_row: float
    m_best_per_row: float
    distance: str
    theta: float | None
    absolute: bool
    mean_probability: float
    n_original: int
    n_masked: int
    covariance_rank: int
    singular: str

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return asdict(self)


def disclosure_risk(original: Any, masked: Any, *, distance: str = "d1", theta: float = 0.5,
                    absolute: bool = False, singular: str = "pinv",
                    precision: str = "float32",
                    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES, n_jobs: int = 1,
                    match: CorrelationMatch | None = None) -> DisclosureRisk:
    """Compute the seed's ``M(A, A¹)`` and ``M_best(A, A¹)`` (eqs. 8 and 13).

    Parameters
    ----------
    original : array_like, shape (m, N)
        ``A``, the real rows (m >= 2).
    masked : array_like, shape (n, N)
        ``A¹``, masked or synthetic rows.
    distance : {"d1", "d2", "d3"}
        Distance used in ``M`` (``M_best`` always uses d1).
    theta : float
        θ in (0, 1) for d3.
    absolute, precision, max_block_bytes, n_jobs
        See :func:`correlation_match`.
    singular : {"pinv", "ridge"}
        See :meth:`MeanDistance.fit`.
    match : CorrelationMatch, optional
        A :func:`correlation_match` result for the same ``original`` and ``masked`` rows, to
        reuse instead of searching again (its ``absolute`` flag is used).
    """
    check_choice(distance, "distance", _DISTANCE_CHOICES)
    t = _theta(theta)
    a = _matrix(original, "original", min_rows=2)
    b = _matrix(masked, "masked")
    _same_width(a, b, "original", "masked")
    metric = MeanDistance.fit(a, singular=singular)
    center = b.mean(axis=0)  # ā¹
    if match is None:
        match = correlation_match(a, b, absolute=absolute, precision=precision,
                                  max_block_bytes=max_block_bytes, n_jobs=n_jobs)
    elif match.probability.shape != (b.shape[0],):
        raise ValidationError(
            f"match must have one probability per masked row ({b.shape[0]}), "
            f"got shape {match.probability.shape}")
    one_minus = 1.0 - match.probability
    d1 = metric.d1_squared(b, center)
    d_chosen = d1 if distance == "d1" else metric.squared(b, distance, theta=t, center=center)
    m_value = float(np.sum(d_chosen * one_minus))  # eq. (8)
    m_best = float(np.sum(d1 * one_minus**2))  # eq. (13)
    n = b.shape[0]
    return DisclosureRisk(
        m=m_value, m_best=m_best, m_per_row=m_value / n, m_best_per_row=m_best / n,
        distance=distance, theta=t if distance == "d3" else None, absolute=match.absolute,
        mean_probability=float(match.probability.mean()), n_original=a.shape[0], n_masked=n,
        covariance_rank=metric.covariance_rank, singular=singular,
    )


def disclosure_m(original: Any, masked: Any, *, distance: str = "d1", theta: float = 0.5,
                 **options: Any) -> float:
    """Return the seed's ``M(A, A¹) = Σ_i d(a_i¹, ā¹)² (1 − P(j | a_i¹))`` (eq. 8).

    ``options``: ``absolute``, ``singular``, ``precision``, ``max_block_bytes``, ``n_jobs`` as
    in :func:`disclosure_risk`.
    """
    return disclosure_risk(original, masked, distance=distance, theta=theta, **options).m


def disclosure_m_best(original: Any, masked: Any, **options: Any) -> float:
    """Return the seed's ``M_best(A, A¹) = Σ_i d1(a_i¹, ā¹)² (1 − P(j | a_i¹))²`` (eq. 13)."""
    return disclosure_risk(original, masked, **options).m_best
