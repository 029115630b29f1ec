"""The fitted generative factor model: from a DP second moment to streamed synthetic rows.

Everything here is post-processing of DP releases (the DP-PCA estimate and the DP link
proportions); no function touches real rows.

:func:`fit_factor_model`
    choose the rank on the noisy spectrum, correct the latent correlation for the links'
    independent draws (:func:`dpfed.common.synth.correlation.fast_latent_correlation`), take its
    top-r eigenpairs plus the PPCA residual, and the per-coordinate rescaling
    (:func:`dpfed.common.synth.factor_model.latent_rescaling`).
:func:`calibrate_proportions`
    the final per-column calibration: proportions for the *decoding* links such that the
    model's latent decodes to exactly the released DP marginals (width-1 columns: their
    thresholds at the exact normal quantiles of the model's latent variance, or at the
    empirical quantiles of given latent rows; nominal columns: a few multiplicative steps).
:meth:`FactorModel.latent` / :func:`iter_samples`
    rows in chunks (memory independent of how many rows are drawn).
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from scipy import special

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.errors import ValidationError
from dpfed.common.pca.dppca import PCAEstimate
from dpfed.common.privacy.rng import derived_rng
from dpfed.common.synth.correlation import fast_latent_correlation
from dpfed.common.synth.latent_model import (
    choose_rank,
    dp_second_moment,
    latent_rescaling,
    residual_variance,
)
from dpfed.common.synth.links import ContinuousLink, LatentLinks, NominalLink, OrdinalLink
from dpfed.common.synth.quantile_link import QuantileLink
from dpfed.common.validation import check_finite_array, check_int

log = logging.getLogger(__name__)

#: Rows per generated chunk.
CHUNK_ROWS = 131072
#: Most simulated rows of the final calibration (and of the pair correction's fit).
CALIBRATION_ROWS = 200_000
#: Fewest of them.
MIN_CALIBRATION_ROWS = 50_000


def calibration_rows(n_rows: int | None = None) -> int:
    """Return the simulated rows of the nominal calibration and the pair correction's fit.

    For data of ``n_rows`` public rows: ten times as many (their sampling error, then, adds
    about 5 % to that of a synthetic table of as many rows as the data), between
    :data:`MIN_CALIBRATION_ROWS` and :data:`CALIBRATION_ROWS`; the most when the row count is
    not known.
    """
    if n_rows is None:
        return CALIBRATION_ROWS
    return int(np.clip(10 * int(n_rows), MIN_CALIBRATION_ROWS, CALIBRATION_ROWS))
#: Most background threads :func:`iter_samples` uses by default (beyond it the Parquet
#: writer, one thread, is the limit).
MAX_WORKERS = 4
_NOMINAL_STEPS = 6
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class FactorModel:
    """``x = (W V^T + E) * multiplier`` with ``W ~ N(0, diag lambda)``, ``E`` the residual.

    Drawn as ``N(0, covariance())`` through one square root of the covariance (same law).

    Attributes
    ----------
    loadings : ndarray (p, r)
        Orthonormal columns.
    eigenvalues : ndarray (r,)
        Factor variances in unit-ball units.
    residual : float
        PPCA residual variance outside the span of ``loadings`` (unit-ball units).
    multiplier : ndarray (p,)
        ``clip_norm`` times the per-coordinate rescaling: unit-ball units -> link units.
    """

    loadings: np.ndarray
    eigenvalues: np.ndarray
    residual: float
    multiplier: np.ndarray
    _root_t: np.ndarray = field(init=False, repr=False, compare=False)

    @property
    def dim(self) -> int:
        """Latent dimension p."""
        return int(self.loadings.shape[0])

    @property
    def rank(self) -> int:
        """Number of factors r."""
        return int(self.loadings.shape[1])

    def __post_init__(self) -> None:
        v = check_finite_array(self.loadings, "loadings", ndim=2)
        p, r = v.shape
        lam = check_finite_array(self.eigenvalues, "eigenvalues", ndim=1)
        mult = check_finite_array(self.multiplier, "multiplier", ndim=1)
        if not 1 <= r <= p or lam.shape != (r,) or mult.shape != (p,):
            raise ValidationError(f"inconsistent factor model: loadings {v.shape}, eigenvalues "
                                  f"{lam.shape}, multiplier {mult.shape}")
        if float(np.abs(v.T @ v - np.eye(r)).max()) > 1e-6:
            raise ValidationError("factor model loadings must have orthonormal columns")
        if not (math.isfinite(self.residual) and self.residual >= 0.0):
            raise ValidationError(f"residual must be finite and >= 0, got {self.residual!r}")
        # One p x p square root of the model covariance: each chunk then costs one normal
        # draw of n x p and one GEMM (instead of factor draws, residual draws and a projection).
        values, vectors = np.linalg.eigh(self.covariance())
        root = vectors * np.sqrt(np.clip(values, 0.0, None))[None, :]
        object.__setattr__(self, "_root_t", np.ascontiguousarray(root.T))

    def latent(self, n_rows: int, rng: np.random.Generator) -> np.ndarray:
        """Draw ``n_rows`` latent rows in link units, ``N(0, covariance())`` (column-major)."""
        n = check_int(n_rows, "n_rows", minimum=0)
        # Computed transposed so the result is column-major: every coordinate is contiguous
        # for the per-column decoding that follows.
        # Single precision for the draw and the product (7 significant digits are far below
        # the model's DP error; about twice as fast); decoding works in float64 per column.
        root = np.ascontiguousarray(self._root_t.T, dtype=np.float32)
        x_t = root @ rng.standard_normal((self.dim, n), dtype=np.float32)
        return np.asarray(x_t.T)

    def covariance(self) -> np.ndarray:
        """Model covariance of :meth:`latent` in link units (p x p)."""
        v = self.loadings
        cov = (v * self.eigenvalues[None, :]) @ v.T + self.residual * (np.eye(self.dim) - v @ v.T)
        return np.asarray(cov * np.outer(self.multiplier, self.multiplier))


def build_factor_model(links: LatentLinks, loadings: np.ndarray, eigenvalues: np.ndarray, *,
                       clip_norm: float, residual: float = 0.0, rescale: bool = True,
                       factor_noise_variance: float = 0.0,
                       include_residual: bool = True) -> FactorModel:
    """Return the :class:`FactorModel` of DP loadings/eigenvalues with its link-unit multiplier.

    The multiplier is ``clip_norm`` times :func:`~dpfed.common.synth.factor_model.
    latent_rescaling` (``rescale=True``) or ``clip_norm`` alone. Row-aligned models pass the
    factor noise variance ``2 b^2`` and ``include_residual=False`` (their rows carry the
    noise, not the residual). Post-processing of DP releases only.
    """
    scale = (latent_rescaling(links, loadings, eigenvalues, clip_norm=clip_norm,
                              residual=residual, factor_noise_variance=factor_noise_variance,
                              include_residual=include_residual)
             if rescale else np.ones(links.dim))
    return FactorModel(np.ascontiguousarray(loadings), np.asarray(eigenvalues, dtype=np.float64),
                       float(residual) if include_residual else 0.0, clip_norm * scale)


def fit_factor_model(estimate: PCAEstimate, links: LatentLinks, *, clip_norm: float,
                     rng: np.random.Generator, rank: int | None = None,
                     info_threshold: float = 0.8, max_rank: int | None = None,
                     correct_correlation: bool = True, residual: bool = True,
                     rescale: bool = True, n_simulations: int | None = None,
                     n_rows: int | None = None) -> tuple[FactorModel, np.ndarray | None]:
    """Build the generative factor model from a DP-PCA estimate of the unit-ball latent rows.

    Returns the model and the corrected latent correlation (None when not corrected).
    ``estimate`` must have been computed on the latent layout of ``links`` (p = links.dim);
    it should carry all p components (otherwise the complement is filled isotropically).
    ``residual=False`` drops the PPCA residual, ``rescale=False`` the per-coordinate
    rescaling; ``n_simulations`` caps the rows of the correlation correction's simulation
    (default: its own adaptive size, which ``n_rows``, the public row count the estimate was
    released from, bounds by ``2 n_rows``:
    :func:`dpfed.common.synth.correlation.simulation_rows`).

    Privacy
    -------
    Post-processing of DP releases only; ``rng`` drives the simulation of the correction.
    """
    p = links.dim
    if estimate.components.ndim != 2 or estimate.components.shape[1] != p:
        raise ValidationError(
            f"the DP-PCA estimate has components of shape {estimate.components.shape}; the "
            f"links define a latent space of dimension {p}: it was not computed on these "
            "links' latent rows")
    available = estimate.components.shape[0]
    if rank is not None:
        r = check_int(rank, "rank", minimum=1, maximum=available)
    else:
        r = choose_rank(estimate.eigenvalues, info_threshold, total=estimate.total_variance,
                        max_rank=max_rank)
    corr: np.ndarray | None = None
    if correct_correlation and bool(np.all(links.standard_normal)):
        sizes = ({} if n_simulations is None else
                 {"max_rows": check_int(n_simulations, "n_simulations", minimum=100),
                  "min_rows": min(20_000, int(n_simulations))})
        corr = fast_latent_correlation(dp_second_moment(estimate, p), links,
                                       clip_norm=clip_norm, rng=rng, n_rows=n_rows, **sizes)
        values, vectors = np.linalg.eigh(corr)
        values, vectors = values[::-1], vectors[:, ::-1]
        idx = np.argmax(np.abs(vectors[:, :r]), axis=0)
        signs = np.sign(vectors[idx, np.arange(r)])
        signs[signs == 0] = 1.0
        loadings = np.ascontiguousarray(vectors[:, :r] * signs[None, :])
        c2 = clip_norm * clip_norm
        kept = np.clip(values[:r], 0.0, None)
        eigenvalues = kept / c2
        left = max(float(np.trace(corr)) - float(kept.sum()), 0.0)
        res = left / (p - r) / c2 if r < p and residual else 0.0
    else:
        loadings = np.ascontiguousarray(estimate.components[:r].T)
        eigenvalues = np.clip(np.asarray(estimate.eigenvalues[:r], dtype=np.float64), 0.0, None)
        res = residual_variance(estimate, r, p) if residual else 0.0
    model = build_factor_model(links, loadings, eigenvalues, clip_norm=clip_norm, residual=res,
                               rescale=rescale)
    return model, corr


def _thresholds_to_proportions(q: np.ndarray) -> np.ndarray:
    """Return the decoding proportions whose normal thresholds are ``q`` (increasing)."""
    u = np.maximum.accumulate(special.ndtr(q))
    edges = np.concatenate([[0.0], u, [1.0]])
    p = np.diff(edges)
    floor = min(1e-9, 0.1 / p.shape[0])
    p = np.clip(p, floor, None)
    return np.asarray(p / p.sum())


def _width_one_calibration(z: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Proportions whose normal thresholds sit at the empirical quantiles of ``z``."""
    cum = np.cumsum(target)[:-1]
    # np.quantile's linear rule on one sort (a partition per level costs far more with the
    # thousands of cells of a fine column).
    ordered = np.sort(z)
    at = np.clip(cum, 0.0, 1.0) * (ordered.shape[0] - 1)
    low = np.floor(at).astype(np.intp)
    high = np.minimum(low + 1, ordered.shape[0] - 1)
    return _thresholds_to_proportions(ordered[low] + (at - low) * (ordered[high] - ordered[low]))


def _width_one_exact(sd: float, target: np.ndarray) -> np.ndarray:
    """Proportions whose normal thresholds sit at the exact quantiles of ``N(0, sd^2)``.

    A latent coordinate that is exactly ``N(0, sd^2)`` (the generative model's) then decodes
    to ``target`` exactly in distribution: no simulated rows, so no sampling error. With
    ``sd = 1`` (the rescaled model's) these are ``target`` itself.
    """
    t = np.asarray(target, dtype=np.float64)
    if abs(sd - 1.0) <= 1e-9 or not sd > 0.0:  # a constant coordinate decodes to its median
        return np.asarray(t / t.sum())
    cum = np.clip(np.cumsum(t)[:-1], 0.0, 1.0)
    return _thresholds_to_proportions(sd * special.ndtri(cum))


def calibrate_proportions(latent: np.ndarray | None, links: LatentLinks, *,
                          variances: np.ndarray | None = None) -> list[np.ndarray | None]:
    """Per column, decoding proportions that make the model's latent decode to the links' marginals.

    ``variances`` (the generative model's latent variances, the diagonal of
    :meth:`FactorModel.covariance`): ordinal and quantile-linked columns get their thresholds
    at the exact normal quantiles of their coordinate's variance matching the DP cumulative
    proportions (:func:`_width_one_exact`). Without them (row-aligned models: reconstructed
    rows, not Gaussian) those thresholds sit at the empirical quantiles of ``latent`` (exact
    on ``latent``). Nominal columns' proportions are scaled by ``target / decoded`` on
    ``latent`` a few times (``latent`` may be None when there are none). Identity-linked
    continuous columns are left as they are (None). Post-processing.
    """
    x = None if latent is None else np.asarray(latent, dtype=np.float64)
    if x is not None and (x.ndim != 2 or x.shape[1] != links.dim):
        raise ValidationError(f"latent must have shape (n, {links.dim}), got {x.shape}")
    var = None if variances is None else check_finite_array(variances, "variances", ndim=1)
    if var is not None and var.shape != (links.dim,):
        raise ValidationError(f"variances must have shape ({links.dim},), got {var.shape}")
    out: list[np.ndarray | None] = []
    for link, start, stop in zip(links.links, links.offsets[:-1], links.offsets[1:],
                                 strict=True):
        if isinstance(link, QuantileLink | OrdinalLink) and var is not None:
            out.append(_width_one_exact(float(np.sqrt(max(var[start], 0.0))),
                                        link.proportions))
            continue
        if isinstance(link, ContinuousLink) and not isinstance(link, QuantileLink):
            out.append(None)
            continue
        if x is None:
            raise ValidationError("calibrate_proportions needs latent rows for column "
                                  f"{link.column.name!r}")
        block = x[:, start:stop]
        if isinstance(link, QuantileLink | OrdinalLink):
            out.append(_width_one_calibration(block[:, 0], link.proportions))
        else:
            assert isinstance(link, NominalLink)
            target = link.proportions
            current = target.copy()
            for _ in range(_NOMINAL_STEPS):
                decoded = NominalLink(link.column, current).inverse(block)
                q = np.bincount(decoded, minlength=target.shape[0]) / max(block.shape[0], 1)
                if float(np.abs(q - target).max()) < 2e-3:
                    break
                current = current * target / np.clip(q, 1e-6, None)
                current = np.clip(current / current.sum(), 1e-6, None)
                current /= current.sum()
            out.append(current)
    return out


def decoding_links(links: LatentLinks, calibrated: list[np.ndarray | None]) -> LatentLinks:
    """Return the links to decode with: the same kinds, built from the calibrated proportions."""
    new: list[ContinuousLink | OrdinalLink | NominalLink] = []
    for link, p in zip(links.links, calibrated, strict=True):
        if p is None:
            new.append(link)
        elif isinstance(link, QuantileLink):
            new.append(QuantileLink(link.column, proportions=p, cells=link.cells))
        elif isinstance(link, OrdinalLink):
            new.append(OrdinalLink(link.column, p))
        else:
            assert isinstance(link, NominalLink)
            new.append(NominalLink(link.column, p))
    return LatentLinks(links.schema, tuple(new))


def default_workers() -> int:
    """Return the default number of background threads of :func:`iter_samples`.

    One fewer than the CPUs this process may use (that one is the consumer's, e.g. the Parquet
    writer's), at most ``MAX_WORKERS``; 0 (draw in the calling thread) on a single CPU.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover -- platforms without sched_getaffinity
        cpus = os.cpu_count() or 1
    return max(0, min(cpus - 1, MAX_WORKERS))


def in_order(fn: Callable[[_T], _R], items: Iterable[_T], workers: int) -> Iterator[_R]:
    """Yield ``map(fn, items)`` computed on ``workers`` background threads, in order.

    At most ``workers + 1`` results are computed ahead of the consumer, so memory stays
    bounded however many items there are; ``workers = 0`` computes each item in the
    consumer's thread when it asks for it.

    Worth it only where ``fn`` spends its time outside the GIL (numpy, BLAS, pyarrow).
    """
    if workers <= 0:
        yield from map(fn, items)
        return
    pending: deque[Future[_R]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dpfed-sample") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def iter_samples(model: FactorModel, decode: LatentLinks, n_rows: int,
                 rng: np.random.Generator, chunk_rows: int = CHUNK_ROWS, *,
                 workers: int | None = None,
                 correct: Callable[[EncodedTable, np.random.Generator], EncodedTable] | None
                 = None) -> Iterator[EncodedTable]:
    """Yield ``n_rows`` synthetic rows in chunks of at most ``chunk_rows`` (post-processing).

    Each chunk is drawn with its own generator derived from ``rng`` in chunk order
    (:func:`dpfed.common.privacy.rng.derived_rng`), so ``workers`` background threads (default
    :func:`default_workers`; 0: the calling thread) can draw and decode chunks in parallel,
    while the consumer writes, and the rows depend on ``rng`` and ``chunk_rows`` only, never
    on ``workers``. At most ``workers + 1`` chunks are computed ahead of the consumer.
    ``correct`` (e.g. :meth:`dpfed.common.synth.pair_marginals.PairCorrection.apply`) is
    applied to every decoded chunk with the chunk's generator.
    """
    n = check_int(n_rows, "n_rows", minimum=0)
    size = check_int(chunk_rows, "chunk_rows", minimum=1)
    threads = default_workers() if workers is None else check_int(workers, "workers", minimum=0)
    if decode.dim != model.dim:
        raise ValidationError(f"links have dimension {decode.dim}, the model {model.dim}")

    def chunks() -> Iterator[tuple[int, np.random.Generator]]:
        for start in range(0, n, size):
            yield min(size, n - start), derived_rng(rng)

    def draw(job: tuple[int, np.random.Generator]) -> EncodedTable:
        table = decode.from_latent(model.latent(*job))
        return table if correct is None else correct(table, job[1])

    yield from in_order(draw, chunks(), threads)
