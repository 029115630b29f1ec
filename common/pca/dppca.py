"""Distributed differentially private PCA (DPdisPCA, Imtiaz & Sarwate, ICASSP 2018).

The split between the two parties is the API:

Site (holds rows, spends budget)
    :class:`GramAccumulator` streams chunks of unit-ball rows into ``G_s = sum x x^T``
    (BLAS ``dsyrk``, memory independent of the row count); :func:`site_release` adds
    symmetric Gaussian noise to ``G_s / N_s`` and returns ``P_s = U_R Sigma_R^{1/2}``.
Coordinator (sees only releases)
    :func:`combine` forms the top-K subspace of ``A_c = (1/S) sum_s P_s P_s^T`` from the thin
    p x SR matrix ``[P_1 ... P_S]`` -- no p x p matrix is built.

Deviations from the seed text and the paper's code (docs/algorithms.md): rows are mapped into the
unit ball with *declared* bounds and a clip (``dpfed.common.pca.features``), not by dividing by the
data's largest norm; the noise is calibrated with the analytic Gaussian by default; negative
eigenvalues of the noisy matrix are clipped to 0 before taking square roots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import linalg

from dpfed.common.errors import ValidationError
from dpfed.common.linalg import mirror_upper, syrk_upper
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import SymmetricGaussianMechanism
from dpfed.common.validation import check_finite_array, check_int

#: L2 sensitivity of the upper triangle (with diagonal) of ``G_s`` for unit-ball rows under
#: replace-one (docs/privacy.md); that of ``G_s / N_s`` is this over ``N_s``. Attained by
#: x = e1 replaced with y = e2.
UNCENTRED_GRAM_SENSITIVITY = math.sqrt(2.0)


class GramAccumulator:
    """Accumulate ``G = sum_i x_i x_i^T`` over row chunks with BLAS ``dsyrk``.

    Only the upper triangle is accumulated (half the flops of ``X^T X``); :meth:`gram`
    mirrors it. Memory is O(p^2) whatever the number of rows. Chunks shorter than
    :data:`MIN_SYRK_ROWS` rows (wide CSV blocks hold a few hundred rows) are gathered into a
    column-major buffer first: at p = 5000 a 290-row ``dsyrk`` ran at a third of the speed
    of a 1000-row one.
    """

    #: Rows per ``dsyrk`` below which chunks are buffered (the buffer is this x p floats).
    MIN_SYRK_ROWS = 1024

    def __init__(self, n_features: int) -> None:
        self.n_features = check_int(n_features, "n_features", minimum=1)
        # Fortran order so dsyrk updates it in place.
        self._upper: np.ndarray | None = np.zeros((self.n_features, self.n_features),
                                                  dtype=np.float64, order="F")
        self._buffer: np.ndarray | None = None
        self._buffered = 0
        self.n_rows = 0

    def add(self, x: np.ndarray) -> None:
        """Add the rows of ``x`` (n x p); column-major (Fortran) order avoids a copy."""
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValidationError(f"chunk must have shape (n, {self.n_features}), got {x.shape}")
        if x.shape[0] == 0:
            return
        if self._upper is None:
            raise ValidationError("gram() was called: this accumulator takes no more rows")
        x = np.asarray(x, dtype=np.float64)
        n = x.shape[0]
        if n >= self.MIN_SYRK_ROWS:
            self._flush()
            self._syrk(x)
        else:
            if self._buffer is None:
                self._buffer = np.empty((self.MIN_SYRK_ROWS, self.n_features), order="F")
            start = 0
            while start < n:
                take = min(n - start, self.MIN_SYRK_ROWS - self._buffered)
                self._buffer[self._buffered:self._buffered + take] = x[start:start + take]
                self._buffered += take
                start += take
                if self._buffered == self.MIN_SYRK_ROWS:
                    self._flush()
        self.n_rows += n

    def _flush(self) -> None:
        if self._buffered:
            assert self._buffer is not None
            self._syrk(self._buffer[:self._buffered])
            self._buffered = 0

    def _syrk(self, x: np.ndarray) -> None:
        self._upper = syrk_upper(x, into=self._upper)

    def gram(self) -> np.ndarray:
        """Return the full symmetric ``G`` (C order) and hand it over: no p x p copy is made.

        The lower triangle is filled in place from the upper one
        (:func:`dpfed.common.linalg.mirror_upper`); the accumulator takes no more rows
        afterwards and a second call raises.
        """
        if self._upper is None:
            raise ValidationError("gram() was already called on this accumulator")
        self._flush()
        self._buffer = None
        g, self._upper = self._upper, None
        # The transpose of the Fortran-ordered G is C-ordered and, G being symmetric, equal.
        return mirror_upper(g).T


@dataclass(frozen=True)
class SitePCARelease:
    """What one site sends: ``P_s`` (p x R) and its public row count."""

    factor: np.ndarray
    n_rows: int
    sigma: float


def pca_mechanism(n_rows: int, epsilon: float, delta: float,
                  calibration: str = "analytic") -> SymmetricGaussianMechanism:
    """Return the mechanism that noises ``G_s / N_s`` (it states its own cost).

    Privacy
    -------
    Neighbouring relation: replace-one (bounded DP, docs/privacy.md): neighbouring site tables
    have the same number of rows ``N_s`` and differ in one row, so ``N_s`` is public (it is sent
    in Hello) and is used as the normaliser. Bounds: every row has ||x||_2 <= 1
    (``dpfed.common.pca.features.UnitBallMap``, public schema bounds and public ``clip_norm``).
    Sensitivity: replacing row x by y changes ``G_s / N_s`` by ``D = (x x^T - y y^T) / N_s``;
    the L2 norm of its upper triangle (with diagonal) is at most ``||D||_F <=
    sqrt(||x||^4 + ||y||^4 - 2 (x.y)^2) / N_s <= sqrt(2) / N_s``, attained by x = e1, y = e2
    (:data:`UNCENTRED_GRAM_SENSITIVITY`). Calibration: symmetric Gaussian with that
    sensitivity, analytic (Balle & Wang 2018) by default, so ``tau = sigma(epsilon, delta, 1)
    sqrt(2) / N_s``; ``calibration="classic"`` uses the paper's formula with the same
    sensitivity, ``tau = sqrt(2) sqrt(2 ln(1.25/delta)) / (N_s epsilon)``, where that is DP.
    (Releases made before this relation was fixed used ``1/N_s``: docs/release-notes.md.)
    """
    n = check_int(n_rows, "n_rows", minimum=1)
    return SymmetricGaussianMechanism(epsilon, delta, UNCENTRED_GRAM_SENSITIVITY / n, calibration)


def site_cost(n_rows: int, epsilon: float, delta: float,
              calibration: str = "analytic") -> PrivacyCost:
    """Return the cost of :func:`site_release` (computable before any noise is drawn).

    Privacy
    -------
    The cost of :func:`pca_mechanism` (replace-one, sensitivity ``sqrt(2)/N_s``); charge it
    to the ledger before :func:`site_release` runs.
    """
    return pca_mechanism(n_rows, epsilon, delta, calibration).cost()


def site_release(gram: np.ndarray, n_rows: int, *, epsilon: float, delta: float, rank: int,
                 rng: np.random.Generator, calibration: str = "analytic",
                 mechanism: SymmetricGaussianMechanism | None = None) -> SitePCARelease:
    """DPdisPCA site step: ``A_s = G_s/N_s + E``; return ``P_s = U_R Sigma_R^{1/2}``.

    Parameters
    ----------
    gram : ndarray (p, p)
        ``sum_i x_i x_i^T`` over this site's unit-ball rows.
    n_rows : int
        ``N_s`` (public).
    epsilon, delta : float
        The site's budget for this release.
    rank : int
        R, the number of eigenpairs sent (DPdisPCA default 2K); at most p.
    rng : numpy.random.Generator
        Noise source (``dpfed.common.privacy.rng.production_rng()`` in production).
    calibration : {"analytic", "classic"}
    mechanism : SymmetricGaussianMechanism, optional
        The noise for ``G_s / N_s`` when the rows are not the uncentred unit-ball rows
        (centred rows: :func:`dpfed.common.pca.centring.centred_pca_mechanism`); default
        :func:`pca_mechanism`.

    Privacy
    -------
    See :func:`pca_mechanism` (or the given ``mechanism``): replace-one with ``N_s`` public,
    unit-ball rows, L2 sensitivity ``sqrt(2)/N_s`` of the upper triangle of ``G_s/N_s``,
    symmetric Gaussian noise (analytic calibration by default); (epsilon, delta)-DP. ``P_s`` is
    post-processing of the noisy ``A_s``.
    """
    g = check_finite_array(gram, "gram", ndim=2)
    p = g.shape[0]
    if g.shape != (p, p):
        raise ValidationError(f"gram must be square, got shape {g.shape}")
    r = check_int(rank, "rank", minimum=1, maximum=p)
    mech = mechanism or pca_mechanism(n_rows, epsilon, delta, calibration)
    noisy = mech.release(g / n_rows, rng)  # Alg. step 2-3: A_s + E, E symmetric
    # Top-R eigenpairs only (LAPACK syevr on an index range): cheaper than a full eigh. The
    # noisy matrix is exactly symmetric, so its transpose -- a Fortran-ordered view -- is the
    # same matrix and LAPACK works on it in place instead of on a p x p copy.
    values, vectors = linalg.eigh(noisy.T, subset_by_index=[p - r, p - 1], overwrite_a=True,
                                  check_finite=False, driver="evr")
    del noisy
    values = values[::-1]
    vectors = vectors[:, ::-1]
    # Negative eigenvalues of the noisy matrix carry no energy: clip before the square root.
    factor = vectors * np.sqrt(np.clip(values, 0.0, None))[None, :]
    return SitePCARelease(np.ascontiguousarray(factor), int(n_rows), mech.sigma)


@dataclass(frozen=True)
class PCAEstimate:
    """The coordinator's DP-PCA result (sklearn orientation: ``components`` is K x p)."""

    components: np.ndarray
    eigenvalues: np.ndarray
    total_variance: float
    #: Every nonzero eigenvalue of A_c (up to min(p, S R)), for scree plots; post-processing.
    spectrum: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def explained_variance_ratio(self) -> np.ndarray:
        """Eigenvalues over the trace of ``A_c`` (the total energy the sites released)."""
        if self.total_variance <= 0:
            return np.zeros_like(self.eigenvalues)
        return np.asarray(self.eigenvalues / self.total_variance)


def _flip_signs(components: np.ndarray) -> np.ndarray:
    """Make the largest-magnitude entry of each component positive (deterministic output)."""
    idx = np.argmax(np.abs(components), axis=1)
    signs = np.sign(components[np.arange(components.shape[0]), idx])
    signs[signs == 0] = 1.0
    return np.asarray(components * signs[:, None])


def combine(factors: list[np.ndarray], n_components: int,
            weights: Sequence[float] | None = None) -> PCAEstimate:
    """DPdisPCA aggregator step: top-K eigenvectors of ``A_c = sum_s w_s P_s P_s^T``.

    ``weights`` default to the paper's ``w_s = 1/S``; size weighting passes ``N_s / N``
    (:func:`site_weights`). Computed as the top-K left singular vectors of
    ``M = [sqrt(w_1) P_1 ... sqrt(w_S) P_S]`` (p x SR): the eigenvalues of ``A_c`` are
    ``s_k^2``. Pure post-processing of the sites' releases (and of the public ``N_s``).
    """
    if not factors:
        raise ValidationError("combine needs at least one site's factor")
    p = factors[0].shape[0]
    for i, f in enumerate(factors):
        if f.ndim != 2 or f.shape[0] != p:
            raise ValidationError(f"factor {i} has shape {f.shape}; expected ({p}, R)")
    n_sites = len(factors)
    w = np.full(n_sites, 1.0 / n_sites) if weights is None else np.asarray(weights, float)
    if w.shape != (n_sites,) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValidationError(f"weights must be {n_sites} finite non-negative numbers")
    m = np.hstack([np.asarray(f, dtype=np.float64) * np.sqrt(wi) for f, wi in zip(factors, w,
                                                                                 strict=True)])
    k = check_int(n_components, "n_components", minimum=1, maximum=min(p, m.shape[1]))
    u, s, _ = linalg.svd(m, full_matrices=False, check_finite=False, lapack_driver="gesdd")
    eigenvalues = s[:k] ** 2
    total = float(np.sum(s ** 2))  # trace(A_c) = ||M||_F^2
    return PCAEstimate(_flip_signs(np.ascontiguousarray(u[:, :k].T)), eigenvalues, total,
                       s ** 2)


def site_weights(n_rows: Sequence[int], weighting: str) -> np.ndarray:
    """``N_s / N`` for ``"size"``, ``1/S`` for ``"equal"`` (the paper's rule)."""
    n = np.asarray(n_rows, dtype=np.float64)
    if weighting == "equal":
        return np.full(len(n), 1.0 / len(n))
    if weighting != "size":
        raise ValidationError(f"site_weighting must be 'size' or 'equal', got {weighting!r}")
    return np.asarray(n / n.sum())


def captured_energy(components: np.ndarray, second_moment: np.ndarray) -> float:
    """``q = tr(V_K^T A V_K)`` with V_K the components as columns (DPdisPCA's utility metric)."""
    v = np.asarray(components, dtype=np.float64)
    return float(np.einsum("ij,jk,ik->", v, second_moment, v))


def top_components(second_moment: np.ndarray, n_components: int) -> np.ndarray:
    """Non-private top-K eigenvectors (K x p) of a symmetric matrix, for baselines."""
    a = np.asarray(second_moment, dtype=np.float64)
    p = a.shape[0]
    k = check_int(n_components, "n_components", minimum=1, maximum=p)
    _, vectors = linalg.eigh(a, subset_by_index=[p - k, p - 1])
    return _flip_signs(np.ascontiguousarray(vectors[:, ::-1].T))
