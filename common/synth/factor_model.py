"""DP synthetic data from a latent factor model (seed 000, Alg. 1 and Alg. 2).

Pipeline (one table, or one site of a federation)::

    typed rows --links--> latent rows x* --clip/C--> unit-ball rows x (||x|| <= 1)
        --DP-PCA--> V~ (p x r), eigenvalues lambda~ --+-- row-aligned:  W~ = X V~ + C
                                                     |                  X~ = W~ V~^T
                                                     +-- generative:    W ~ N(0, diag lambda~)
                                                                        X~ = W V~^T (+ residual)
        X~ --*C, rescale--> latent --inverse links--> typed synthetic rows

The split between the two parties is the API (the distributed job runs the same functions):

Site (holds rows, spends budget)
    :class:`dpfed.common.synth.link_release.LinkHistogramAccumulator` and
    :func:`dpfed.common.synth.link_release.release_link_histograms` (DP histograms),
    :meth:`dpfed.common.synth.links.LatentLinks.to_latent`,
    :func:`dpfed.common.synth.links.clip_to_unit_ball`,
    :func:`dpfed.common.pca.dppca.site_release` (DP-PCA), :func:`factor_release` (row-aligned mode:
    the only row-aligned DP release).
Coordinator (sees only DP releases)
    :mod:`dpfed.common.synth.pipeline` (links from the summed histograms, size-weighted
    combine, the factor model of :mod:`dpfed.common.synth.generative` with the correlation
    correction of :mod:`dpfed.common.synth.correlation`, the final calibration), built on
    :func:`choose_rank`, :func:`residual_variance`, :func:`dp_second_moment` and
    :func:`latent_rescaling` (defined in :mod:`dpfed.common.synth.latent_model`, re-exported
    here; all pure post-processing: any number of rows, no extra budget).

:class:`FactorModelSynthesizer` runs everything centrally in a few lines, through the same
coordinator functions as the federated ``synth`` job (one site: this table). The older
one-shot helpers :func:`sample_generative`, :func:`reconstruct_rows` and
:func:`latent_correlation` (the reference implementation the fast correction is checked and
timed against) remain available.

Corrections to the seed (docs/algorithms.md)
-----------------------------------------------------------------
* Factor noise: the seed noises only the r-th column of C with Lap(2/epsilon_2) and releases
  the other r-1 columns of ``X V~`` exactly -- not private. Here *every* entry of C is
  Lap(2 sqrt(r) / epsilon_2) (see :func:`factor_mechanism`).
* Loadings: ``V~`` is the output of DP-PCA (already private). The seed's perturbation
  ``QR(V + B)`` with ``B ~ Lap(2 sqrt(p) / epsilon_1i)`` relies on an eigenvector sensitivity
  bound that does not exist without an eigengap, so it is *not* offered as a privacy
  mechanism on non-private ``V``; :func:`perturb_loadings` applies it to DP loadings as
  optional post-processing that costs nothing and protects nothing extra.
* Generative mode (not in the seed): new factors from the DP eigenvalues, plus an isotropic
  residual with the probabilistic-PCA variance (Tipping & Bishop 1999) so the latent
  covariance keeps its total variance; no row-aligned release at all.
* Correlation correction (generative mode, post-processing, not in the seed): the links
  draw each row's latent values independently of its other columns, which attenuates the
  latent correlations involving categorical columns; the correction
  (:func:`dpfed.common.synth.correlation.fast_latent_correlation`, a faster form of
  :func:`latent_correlation`) undoes that by simulated method of moments before the factor
  model is built.
* Latent rescaling (post-processing, not in the seed): the links make every ordinal, nominal
  and DP-standardised continuous coordinate N(0, 1) marginally; clipping and factor noise
  change that variance, which shifts decoded category proportions. :func:`latent_rescaling`
  restores the modelled variance of each coordinate from DP quantities only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from dpfed.common.data.encoding import EncodedTable, EncodingReport, RowPolicy, encode_table
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.job_params import SYNTH_DEFAULT_SPLIT, SYNTH_MAX_BINS, SYNTH_PAIRS_DEFAULT_SPLIT
from dpfed.common.pca import dppca
from dpfed.common.pca.dppca import GramAccumulator, PCAEstimate
from dpfed.common.privacy.accounting import PrivacyCost, zcdp_to_epsilon
from dpfed.common.privacy.composition import COMPOSITIONS, split_budget
from dpfed.common.privacy.mechanisms import LaplaceMechanism
from dpfed.common.privacy.rng import resolve_rng
from dpfed.common.synth.column_cells import check_resolution
from dpfed.common.synth.generative import (
    FactorModel,
    build_factor_model,
    fit_factor_model,
    iter_samples,
)
from dpfed.common.synth.latent_model import (
    _check_loadings,
    _correlation_of,
    _nearest_correlation,
    check_factor_inputs,
)
from dpfed.common.synth.latent_model import choose_rank as choose_rank
from dpfed.common.synth.latent_model import dp_second_moment as dp_second_moment
from dpfed.common.synth.latent_model import latent_rescaling as latent_rescaling
from dpfed.common.synth.latent_model import residual_variance as residual_variance
from dpfed.common.synth.link_release import (
    CONTINUOUS_LINKS,
    LinkHistogramAccumulator,
    link_histogram_mechanism,
    link_round_cost,
    release_link_histograms,
    release_noise_sd,
)
from dpfed.common.synth.links import (
    CONTINUOUS_SCALINGS,
    LatentLinks,
    NominalLink,
    clip_to_unit_ball,
    combine_link_statistics,
    default_clip_norm,
    fit_link_statistics,
    latent_dim,
    needs_link_statistics,
)
from dpfed.common.synth.missing_cells import from_cells_table, synth_schema, to_cells_table
from dpfed.common.synth.pair_marginals import (
    DEFAULT_GROUPS,
    MAX_GROUPS,
    MAX_PAIR_CELLS,
    Pair,
    PairCorrection,
    PairGrid,
    PairTableAccumulator,
    dependence_scores,
    pair_table_mechanism,
    score_mechanism,
)
from dpfed.common.synth.pipeline import (
    aligned_latent,
    calibrated_links,
    fit_pairs,
    links_from_histograms,
    pair_forest,
    row_aligned_model,
)
from dpfed.common.synth.quantile_link import DEFAULT_BINS
from dpfed.common.validation import (
    check_choice,
    check_delta,
    check_epsilon,
    check_finite_array,
    check_int,
    check_nonnegative,
    check_positive,
    check_probability,
)

if TYPE_CHECKING:  # pandas only where a DataFrame is made (a slow import)
    import pandas as pd

log = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("generative", "row_aligned")
#: The ``synth`` job's default (epsilon share, delta share) per round when its two pair
#: rounds run (generative mode, ``pairs`` > 0; docs/synthesis.md).
PAIRS_DEFAULT_SPLIT: Mapping[str, tuple[float, float]] = SYNTH_PAIRS_DEFAULT_SPLIT


def _job_shares(mode: str, pairs: bool) -> dict[str, tuple[float, float]]:
    """Return the job's default (epsilon, delta) shares under this class's release names."""
    shares = (PAIRS_DEFAULT_SPLIT if pairs and mode == "generative"
              else SYNTH_DEFAULT_SPLIT[mode])
    return {("marginals" if name == "links" else name): pair for name, pair in shares.items()}


#: Default share of the total epsilon per release (renormalised over the releases a run needs):
#: the ``synth`` job's default split, so a central and a federated fit spend alike. Without
#: pair tables (``pairs=0``):
DEFAULT_BUDGET_SPLIT: Mapping[str, Mapping[str, float]] = {
    mode: {name: shares[0] for name, shares in _job_shares(mode, False).items()}
    for mode in MODES
}
#: ... and with them (generative mode, ``pairs`` > 0, the default).
PAIRS_BUDGET_SPLIT: Mapping[str, float] = {
    name: shares[0] for name, shares in _job_shares("generative", True).items()}
BUDGET_PARTS: tuple[str, ...] = ("marginals", "pca", "factors", "pair_scores", "pairs")
_CHUNK_ROWS = 65536
_UNIT_BALL_TOL = 1e-9


# --------------------------------------------------------------------------- rank


# --------------------------------------------------------------------------- subspace


def _check_unit_rows(rows: np.ndarray, name: str = "latent_rows") -> np.ndarray:
    x = check_finite_array(rows, name, ndim=2)
    norms_sq = np.einsum("ij,ij->i", x, x)
    if norms_sq.size and float(norms_sq.max()) > (1.0 + _UNIT_BALL_TOL) ** 2:
        raise ValidationError(
            f"{name} must lie in the unit L2 ball "
            "(use dpfed.common.synth.links.clip_to_unit_ball); "
            f"largest norm {math.sqrt(float(norms_sq.max())):.6g}")
    return x


def central_dp_pca(unit_rows: np.ndarray, *, epsilon: float, delta: float,
                   rng: np.random.Generator, n_released: int | None = None,
                   calibration: str = "analytic") -> tuple[PCAEstimate, PrivacyCost]:
    """DP eigendecomposition of one table's unit-ball rows (DPdisPCA with one site).

    Runs :class:`dpfed.common.pca.dppca.GramAccumulator`,
    :func:`dpfed.common.pca.dppca.site_release` and
    :func:`dpfed.common.pca.dppca.combine` with a single site, releasing ``n_released`` eigenpairs
    (default all p, so :func:`choose_rank` sees the full noisy spectrum).

    Privacy
    -------
    :func:`dpfed.common.pca.dppca.pca_mechanism`: replace-one row with ``N`` public,
    ``||x|| <= 1``, L2 sensitivity ``sqrt(2)/N`` of the upper triangle of ``G/N``, symmetric
    Gaussian noise with the analytic calibration; (epsilon, delta)-DP. The eigenpairs are
    post-processing. The latent rows are a per-row randomised map of the data, so neighbouring
    tables give unit-ball latent tables that differ in one row.
    """
    x = _check_unit_rows(unit_rows, "unit_rows")
    n, p = x.shape
    if n == 0:
        raise DataError("no rows to fit")
    released = p if n_released is None else check_int(n_released, "n_released", minimum=1,
                                                      maximum=p)
    acc = GramAccumulator(p)
    for start in range(0, n, _CHUNK_ROWS):
        acc.add(x[start:start + _CHUNK_ROWS])
    cost = dppca.site_cost(n, epsilon, delta, calibration)
    release = dppca.site_release(acc.gram(), n, epsilon=epsilon, delta=delta, rank=released,
                                 rng=rng, calibration=calibration)
    return dppca.combine([release.factor], n_components=released), cost


def orthonormalize(matrix: np.ndarray) -> np.ndarray:
    """Return ``Q`` of the thin QR decomposition, signs fixed so that ``diag(R) >= 0``.

    So ``Q = V`` when V is already orthonormal: the seed's ``g(.)`` (Alg. 1 step 2(ii)).
    """
    a = check_finite_array(matrix, "matrix", ndim=2)
    if a.shape[1] > a.shape[0]:
        raise ValidationError(f"need at least as many rows as columns, got {a.shape}")
    q, r = np.linalg.qr(a)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return np.asarray(q * signs[None, :])


def _flip_columns(vectors: np.ndarray) -> np.ndarray:
    """Make the largest-magnitude entry of each column positive (deterministic signs)."""
    idx = np.argmax(np.abs(vectors), axis=0)
    signs = np.sign(vectors[idx, np.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return np.asarray(vectors * signs[None, :])


def perturb_loadings(loadings: np.ndarray, *, epsilon: float, rng: np.random.Generator,
                     eigenvalues: np.ndarray | None = None) -> np.ndarray:
    """Seed Alg. 1 step 2 applied to *DP* loadings: ``V~ = QR(V + B)``.

    ``B_{:,i} ~ Lap(2 sqrt(p) / (omega_i epsilon))`` with ``omega_i = 1/r``, or
    ``nu_i / sum nu`` when ``eigenvalues`` are given (the seed's two allocations).

    Privacy
    -------
    None claimed. Apply this only to loadings that are already DP (the output of DP-PCA):
    then it is post-processing and costs nothing. On non-private eigenvectors the seed
    presents it as an epsilon_1-DP mechanism, but that needs an eigenvector sensitivity
    bound, which does not exist without an eigengap assumption (research/papers.md
    section 2); dpfed does not offer that path.
    """
    v = check_finite_array(loadings, "loadings", ndim=2)
    eps = check_epsilon(epsilon)
    p, r = v.shape
    if eigenvalues is None:
        weights = np.full(r, 1.0 / r)
    else:
        nu = np.clip(check_finite_array(eigenvalues, "eigenvalues", ndim=1)[:r], 0.0, None)
        if nu.shape[0] != r or nu.sum() <= 0:
            raise ValidationError(f"need {r} eigenvalues with a positive sum")
        weights = np.maximum(nu / nu.sum(), 1e-12)
    scales = 2.0 * math.sqrt(p) / (weights * eps)
    noise = rng.laplace(0.0, 1.0, size=(p, r)) * scales[None, :]
    return orthonormalize(v + noise)


# --------------------------------------------------------------------------- factors


def factor_mechanism(rank: int, epsilon: float) -> LaplaceMechanism:
    """Return the Laplace mechanism of :func:`factor_release` (it states its own cost).

    Privacy
    -------
    Neighbouring relation: replace-one row, the system's relation (docs/privacy.md). The
    release is row-aligned (output row i is a noisy copy of input row i), so it needs N fixed
    and public, which replace-one gives.
    Bounds: ``||x_i||_2 <= 1`` (unit-ball latent rows); ``V~`` has orthonormal columns and is
    a DP release made before (public to this step). Sensitivity: replacing ``x_i`` by
    ``x_i'`` changes only row i of ``X V~``, by ``V~^T (x_i - x_i')``, whose L2 norm is at most
    ``||x_i - x_i'||_2 <= 2``; an r-vector with L2 norm 2 has L1 norm at most ``2 sqrt(r)``.
    Calibration: every entry of C is Lap(2 sqrt(r) / epsilon): epsilon-DP (Laplace
    mechanism on the n x r matrix, L1 sensitivity 2 sqrt(r)).

    Deviation from the seed (Alg. 1 step 3(I)): the seed noises only the r-th column with
    Lap(2/epsilon_2) and releases the other r-1 columns of ``X V~`` exactly, which is not DP.
    """
    r = check_int(rank, "rank", minimum=1)
    return LaplaceMechanism(check_epsilon(epsilon), 2.0 * math.sqrt(r))


def factor_cost(rank: int, epsilon: float) -> PrivacyCost:
    """Privacy cost of :func:`factor_release` (before any noise is drawn)."""
    return factor_mechanism(rank, epsilon).cost()


def _project(latent_rows: np.ndarray, loadings: np.ndarray) -> np.ndarray:
    """``X V`` without noise (the non-private factors; tests and the mechanism use it)."""
    return np.asarray(latent_rows @ loadings)


def factor_release(latent_rows: np.ndarray, loadings: np.ndarray, *, epsilon: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, PrivacyCost]:
    """Site step (Alg. 1 step 3, corrected): ``W~ = X V~ + C``, every ``C_ik ~ Lap(2 sqrt(r)/eps)``.

    Parameters
    ----------
    latent_rows : ndarray (n, p)
        Unit-ball latent rows (``||x|| <= 1``; checked).
    loadings : ndarray (p, r)
        ``V~`` with orthonormal columns (checked), from DP-PCA.
    epsilon : float
        ``epsilon_2`` of the seed.
    rng : numpy.random.Generator

    Returns
    -------
    (ndarray (n, r), PrivacyCost)

    Privacy
    -------
    See :func:`factor_mechanism`: replace-one, L1 sensitivity ``2 sqrt(r)``,
    Lap(2 sqrt(r) / epsilon) on every entry, epsilon-DP. The latent rows are a per-row
    randomised map of the data (each row's latent draw depends only on that row and fresh
    randomness), so neighbouring tables give latent tables that differ in one row.
    """
    x = _check_unit_rows(latent_rows)
    v = _check_loadings(loadings, x.shape[1])
    mech = factor_mechanism(v.shape[1], epsilon)
    return mech.release(_project(x, v), rng), mech.cost()


# --------------------------------------------------------------------------- decoding


def decode_rows(unit_rows: np.ndarray, links: LatentLinks, *, clip_norm: float,
                scale: np.ndarray | None = None) -> EncodedTable:
    """Undo the unit-ball scaling and apply the inverse links (Alg. 2 step 4).

    Rows are multiplied by ``clip_norm`` (and ``scale`` per coordinate). Post-processing.
    """
    c = check_positive(clip_norm, "clip_norm")
    x = np.asarray(unit_rows, dtype=np.float64)
    multiplier = np.full(links.dim, c) if scale is None else c * np.asarray(scale)
    return links.from_latent(x * multiplier[None, :])


def reconstruct_rows(factors: np.ndarray, loadings: np.ndarray, links: LatentLinks, *,
                     clip_norm: float, scale: np.ndarray | None = None) -> EncodedTable:
    """Row-aligned synthesis (Alg. 1 step 4 + Alg. 2 step 4): ``X~ = W~ V~^T`` -> typed rows.

    Post-processing of :func:`factor_release` (no budget); vectorised in row chunks.
    """
    w = check_finite_array(factors, "factors", ndim=2)
    v = _check_loadings(loadings, links.dim)
    if w.shape[1] != v.shape[1]:
        raise ValidationError(f"factors have {w.shape[1]} columns, loadings {v.shape[1]}")
    c = check_positive(clip_norm, "clip_norm")
    multiplier = np.full(links.dim, c) if scale is None else c * np.asarray(scale)
    vt = v.T * multiplier[None, :]  # fold the unit-ball undo and the rescaling into V^T
    parts = [links.from_latent(w[s:s + _CHUNK_ROWS] @ vt)
             for s in range(0, max(w.shape[0], 1), _CHUNK_ROWS)]
    return EncodedTable.concatenate(parts)


def sample_generative(n_rows: int, loadings: np.ndarray, eigenvalues: np.ndarray,
                      links: LatentLinks, *, clip_norm: float, rng: np.random.Generator,
                      residual: float = 0.0, rescale: bool = True) -> EncodedTable:
    """Coordinator step, generative mode: new rows from the DP factor model.

    ``W ~ N(0, diag(lambda~))`` (n x r), ``X = W V~^T + E`` with ``E = sigma (Z - Z V~ V~^T)``,
    ``Z ~ N(0, I_p)``, ``sigma^2 = residual`` (PPCA residual; 0 to omit), then times
    ``clip_norm`` (undoing the unit-ball scaling: ``lambda~`` are eigenvalues of the unit-ball
    second-moment matrix ``G/N``), times :func:`latent_rescaling` when ``rescale``, then the
    inverse links.

    Privacy
    -------
    Pure post-processing of DP releases (the DP-PCA's ``V~`` and ``lambda~`` and the DP link
    statistics): no budget, any number of rows, and no synthetic row is tied to a real row.
    """
    n = check_int(n_rows, "n_rows", minimum=0)
    v, lam, c, res = check_factor_inputs(loadings, eigenvalues, links.dim, clip_norm, residual)
    scale = (latent_rescaling(links, v, lam, clip_norm=c, residual=res) if rescale
             else np.ones(links.dim))
    multiplier = c * scale
    # W V^T with W = Z_r sqrt(lambda): fold sqrt(lambda), the undo and the rescaling into one
    # r x p matrix, so each chunk costs one normal draw and one GEMM.
    factor_map = (np.sqrt(lam)[:, None] * v.T) * multiplier[None, :]
    sigma = math.sqrt(res)
    parts: list[EncodedTable] = []
    for start in range(0, max(n, 1), _CHUNK_ROWS):
        m = min(_CHUNK_ROWS, n - start)
        latent = rng.standard_normal((m, v.shape[1])) @ factor_map
        if sigma > 0.0:
            z = rng.standard_normal((m, links.dim))
            z -= (z @ v) @ v.T  # project out the factor subspace: E has covariance I - VV^T
            z *= sigma * multiplier[None, :]
            latent += z
        parts.append(links.from_latent(latent))
    return EncodedTable.concatenate(parts)


# --------------------------------------------------------------------------- correction


def latent_correlation(second_moment: np.ndarray, links: LatentLinks, *, clip_norm: float,
                       rng: np.random.Generator, n_simulations: int = 50_000,
                       iterations: int = 8) -> np.ndarray:
    """Correct the latent correlation for the links' independent draws (post-processing).

    The forward links draw each row's latent value *independently* of its other columns
    given its codes (the truncated normals of :mod:`dpfed.common.synth.links`), so the correlation
    of the
    latent rows -- what DP-PCA sees -- is attenuated wherever an ordinal or nominal column is
    involved (for a binary column by about 2/pi). A Gaussian latent sampled with that
    correlation and decoded attenuates it a second time. This finds the correlation matrix
    ``R`` of the link model ``z ~ N(0, R)`` whose whole pipeline -- decode, forward links,
    clip into the unit ball -- reproduces the correlations of the DP ``second_moment``:
    simulated method of moments, with a fixed-point update
    ``R <- R + (target - simulated) / slope`` on the off-diagonal (slope = the attenuation
    measured at the first step), common random numbers across iterations, and a projection
    onto PSD unit-diagonal matrices after each step. The coordinates of one nominal column
    stay uncorrelated, as the probit link model has them.

    Parameters
    ----------
    second_moment : ndarray (p, p)
        DP second moment of the unit-ball latent rows (:func:`dp_second_moment`).
    links : LatentLinks
        Every latent coordinate must be standard normal under the link model (ordinal,
        nominal, DP-standardised continuous).
    clip_norm : float
        The public norm bound the rows were clipped to.
    rng : numpy.random.Generator
        Source of the simulation (no data is touched).
    n_simulations, iterations : int
        Simulated rows per step (Monte-Carlo error about ``1/sqrt(n_simulations)`` per
        correlation) and number of steps.

    Privacy
    -------
    Pure post-processing of DP releases (the DP second moment and the DP link statistics);
    the simulation draws only from the model. Not in the seed: a deviation that keeps the
    generative mode's correlations between categorical columns (the seed's row-aligned mode
    reuses each real row's own latent draw and does not need it).
    """
    s = check_finite_array(second_moment, "second_moment", ndim=2)
    p = links.dim
    if s.shape != (p, p):
        raise ValidationError(f"second_moment must be {p} x {p}, got {s.shape}")
    if not bool(np.all(links.standard_normal)):
        raise ValidationError(
            "latent_correlation needs every latent coordinate standard normal "
            "(continuous_scaling='dp')")
    c = check_positive(clip_norm, "clip_norm")
    n_sim = check_int(n_simulations, "n_simulations", minimum=100)
    steps = check_int(iterations, "iterations", minimum=1)
    # Entries the fit may change: off-diagonal, and not between two coordinates of the same
    # nominal column -- the probit link model has them independent (its locations were fitted
    # to the proportions under N(m, I)), so they stay 0.
    free = ~np.eye(p, dtype=bool)
    for link, start, stop in zip(links.links, links.offsets[:-1], links.offsets[1:],
                                 strict=True):
        if isinstance(link, NominalLink):
            free[start:stop, start:stop] = False
    target = _correlation_of(s)
    within = ~free & ~np.eye(p, dtype=bool)
    r = _nearest_correlation(np.where(free, target, np.eye(p)), within)
    base = rng.standard_normal((n_sim, p))  # common random numbers for every step
    draw_seed = int(rng.integers(0, 2 ** 63))
    slope: np.ndarray | None = None
    for _ in range(steps):
        values, vectors = np.linalg.eigh(r)
        z = base @ (vectors * np.sqrt(np.clip(values, 0.0, None))[None, :]).T
        latent = links.to_latent(links.from_latent(z), np.random.default_rng(draw_seed))
        unit, _ = clip_to_unit_ball(latent, c)
        simulated = _correlation_of(unit.T @ unit)
        if slope is None:
            slope = np.ones((p, p))
            strong = free & (np.abs(r) > 0.05)
            slope[strong] = np.clip(simulated[strong] / r[strong], 0.3, 1.2)
        step = np.where(free, (target - simulated) / slope, 0.0)
        r = _nearest_correlation(r + step, within)
    return r


# --------------------------------------------------------------------------- synthesizer


def _budget_split(mode: str, split: Mapping[str, float] | None,
                  pairs: bool) -> dict[str, float]:
    default = PAIRS_BUDGET_SPLIT if pairs else DEFAULT_BUDGET_SPLIT[mode]
    chosen = dict(default if split is None else split)
    for key, value in chosen.items():
        check_choice(key, "budget_split key", BUDGET_PARTS)
        check_nonnegative(value, f"budget_split[{key!r}]")
    return chosen


class FactorModelSynthesizer:
    """Central DP synthesizer: one table in, one DP synthetic table of the same schema out.

    Parameters
    ----------
    schema : Schema
        Public column types, bounds, levels and categories.
    epsilon : float
        Total epsilon, split between the releases by ``budget_split``.
    delta : float
        Total delta, split between the Gaussian releases (the link histograms and the DP-PCA)
        in the ``synth`` job's delta shares (``delta_budget_`` after fit); the "bounds"
        marginals and the row-aligned factors are pure epsilon-DP.
    mode : {"generative", "row_aligned"}
        ``generative`` (default): new rows from the DP factor model, post-processing of the
        DP-PCA, any number of rows. ``row_aligned``: the seed's ``X~ = (X V~ + C) V~^T``, one
        synthetic row per real row (a noisy copy of it; relation replace-one).
    rank : int, optional
        Number of factors r; default the cumulative-information rule on the noisy eigenvalues.
    info_threshold : float
        ``c`` of the rule ``r(c)`` (0.8 default; the seed suggests 0.8 or 0.9).
    max_rank : int, optional
        Cap on the rank chosen by the rule.
    budget_split : mapping, optional
        Shares of ``epsilon`` for ``"marginals"`` (link statistics), ``"pca"``,
        ``"factors"`` (row-aligned only), ``"pair_scores"`` and ``"pairs"`` (generative
        mode with ``pairs`` > 0). Defaults: the ``synth`` job's split, generative with pair
        tables ``{marginals: 0.6, pca: 0.25, pair_scores: 0.03, pairs: 0.12}``
        (:data:`PAIRS_DEFAULT_SPLIT`), generative with ``pairs=0`` ``{marginals: 0.8, pca:
        0.2}``, row-aligned ``{marginals: 0.2, pca: 0.2, factors: 0.6}``
        (:data:`dpfed.common.job_params.SYNTH_DEFAULT_SPLIT`; measured with
        ``bench/synth_quality.py``; see docs/synthesis.md). Releases a run does not need (no
        categorical or DP-scaled column, a given ``subspace``, generative mode's factors)
        get no budget and the other shares are renormalised.
    continuous_scaling : {"dp", "bounds"}
        "dp" (default): the ``synth`` job's link round -- a Gaussian DP histogram of every
        column (continuous ones on ``n_bins`` public bins) and the links of
        ``continuous_link``. "bounds" (row-aligned mode only): continuous columns scaled by
        the public schema bounds, Laplace DP histograms of the categorical columns only.
    continuous_link : {"quantile", "identity"}
        With "dp": the DP CDF on the public bins (default) or the DP mean/sd of the binned
        density (:mod:`dpfed.common.synth.link_release`).
    n_bins : int
        Public equal-width bins per continuous column (default 32).
    clip_norm : float, optional
        Public norm bound of the latent rows; default ``sqrt(latent dimension)``.
    min_proportion : float
        Floor of every DP category proportion (keeps thresholds finite).
    rescale_latent : bool
        Apply :func:`latent_rescaling` before the inverse links (default True).
    residual : bool
        Generative mode: add the PPCA residual outside the top-r subspace (default True).
    correct_correlation : bool
        Generative mode: build the factor model from the latent correlation corrected for
        the links' independent draws (the job's
        :func:`dpfed.common.synth.correlation.fast_latent_correlation`; default True). False
        gives the plain DP-PCA eigenpairs.
    n_simulations : int, optional
        Most simulated rows per step of that correction (default: twice the rows fitted,
        between 10 000 and 50 000, :func:`dpfed.common.synth.correlation.simulation_rows`).
    subspace : PCAEstimate, optional
        A DP subspace computed elsewhere on the unit-ball latent rows of ``links`` (with the
        same ``clip_norm``); then no PCA budget is spent here. Needs ``links``. A ``pca`` job
        result is refused: it lives in the feature space, not the latent space (``dpfed
        synth`` computes its DP-PCA in the latent space).
    links : LatentLinks, optional
        DP links fitted elsewhere (e.g. the federated link round); then no marginal budget
        is spent here.
    loading_noise_epsilon : float, optional
        Apply the seed's ``QR(V + B)`` perturbation (:func:`perturb_loadings`) with this
        epsilon_1: post-processing of the DP loadings, costs nothing, reproduces the seed.
    pca_calibration : {"analytic", "classic"}
    row_policy : RowPolicy, optional
        Passed to :func:`dpfed.common.data.encoding.encode_table`.
    rng : numpy.random.Generator, optional
        Noise source; default a fresh production generator
        (``dpfed.common.privacy.rng.resolve_rng``).
    pairs : int, optional
        Most DP 2-way marginals (column pairs) measured and fitted by the correction of
        :mod:`dpfed.common.synth.pair_marginals`, as the job's ``pair_scores`` and ``pairs``
        rounds do. Default: number of columns - 1 (a spanning tree) in generative mode with
        ``continuous_scaling="dp"``, no given ``links`` and a ``budget_split`` that is the
        default or names ``"pair_scores"`` or ``"pairs"``; else 0. 0 disables them.
    pair_groups : int
        Most groups per ordinal or continuous column in a pair table (2..64, default 6).
    composition : {"basic", "zcdp"}
        ``basic`` (default): every release gets its share of ``epsilon`` and ``delta``.
        ``zcdp``: its share of the zCDP rho that ``(epsilon, delta)`` converts to (the ``synth``
        job's ``--composition zcdp``, :mod:`dpfed.common.privacy.composition`): much less
        noise per release; every release must then be Gaussian (generative mode,
        ``continuous_scaling="dp"``, analytic calibration).
    resolution, pair_gate, missing_cells, heaps
        The ``synth`` job parameters of the same names (:class:`dpfed.common.job_params.
        SynthParams`); the defaults are a new job's.

    Attributes (after fit)
    ----------------------
    links_ : LatentLinks
        The links of the DP marginals.
    decode_links_ : LatentLinks
        The calibrated links samples are decoded with (every synthetic column reproduces its
        released DP marginal).
    proportions_ : ndarray or None
        The released DP proportions, one block per column ("dp" scaling; None otherwise).
    model_ : FactorModel
        The fitted factor model (:mod:`dpfed.common.synth.generative`).
    components_ : ndarray (r, p)
        The loadings (sklearn orientation).
    eigenvalues_ : ndarray (r,)
        Factor variances in unit-ball units: the noisy DP-PCA eigenvalues, or (generative
        mode with ``correct_correlation``) those of the corrected latent correlation / C^2.
    latent_correlation_ : ndarray (p, p) or None
        The corrected latent correlation (generative mode with ``correct_correlation``).
    rank_ : int
    residual_variance_ : float
    clip_norm_ : float
    n_rows_ : int
    n_clipped_ : int
        Latent rows shrunk to ``clip_norm`` (site-internal diagnostic).
    encoding_report_ : EncodingReport
    pair_grid_ : PairGrid or None
        The pair tables' cells (with ``pairs`` > 0).
    pair_edges_ : list of (int, int)
        The measured (parent, child) column pairs, parents first (empty without pairs).
    pair_correction_ : PairCorrection or None
        The correction applied to every sampled chunk (None without pairs).
    budget_ : dict[str, float]
        Epsilon given to each release (a skipped pair release -- no candidate pair -- keeps
        its share unspent).
    delta_budget_ : dict[str, float]
        Delta given to each Gaussian release.
    privacy_costs_ : dict[str, PrivacyCost]
        Cost of each release made by :meth:`fit`.
    privacy_cost_ : PrivacyCost
        Their composition: basic (epsilons and deltas add), or under ``zcdp`` the rhos add
        and the epsilon is their conversion at ``delta`` (at most ``epsilon``).

    Privacy
    -------
    One relation for every release, replace-one row with ``N`` public (docs/privacy.md):
    ``marginals`` ("dp": the job's link round,
    :func:`dpfed.common.synth.link_release.link_histogram_mechanism`, Gaussian with L2
    sensitivity ``sqrt(2 n_columns)``, (epsilon, delta)-DP; "bounds": Laplace, ``Delta_1 = 2``
    per categorical histogram, epsilon-DP) + ``pca`` (Gaussian, ``sqrt(2)/N``,
    (epsilon, delta)-DP) + ``factors`` (row-aligned only: Laplace, ``2 sqrt(r)``, epsilon-DP)
    + ``pair_scores`` (:func:`dpfed.common.synth.pair_marginals.score_mechanism`, Gaussian,
    ``2 sqrt(P)`` over the ``P`` candidate pairs) + ``pairs``
    (:func:`dpfed.common.synth.pair_marginals.pair_table_mechanism`, Gaussian, ``sqrt(2 K)``
    over the ``K`` chosen pairs).
    ``privacy_cost_`` adds them (basic composition: the epsilons and the deltas of
    ``budget_`` and ``delta_budget_`` sum to ``epsilon`` and ``delta``) and is the true cost
    under that relation. Everything after the releases (links, correction, calibration,
    sampling; the forest of pairs, the raking and the pair correction) is the job's
    post-processing (:mod:`dpfed.common.synth.pipeline`). Nothing is
    charged to any ledger: this is library use.
    """

    def __init__(self, schema: Schema, *, epsilon: float, delta: float = 1e-6,
                 mode: str = "generative", rank: int | None = None,
                 info_threshold: float = 0.8, max_rank: int | None = None,
                 budget_split: Mapping[str, float] | None = None,
                 continuous_scaling: str = "dp", continuous_link: str = "quantile",
                 n_bins: int = DEFAULT_BINS, clip_norm: float | None = None,
                 min_proportion: float = 1e-4, rescale_latent: bool = True,
                 residual: bool = True, correct_correlation: bool = True,
                 n_simulations: int | None = None, subspace: PCAEstimate | None = None,
                 loading_noise_epsilon: float | None = None,
                 pca_calibration: str = "analytic", row_policy: RowPolicy | None = None,
                 rng: np.random.Generator | None = None,
                 links: LatentLinks | None = None, pairs: int | None = None,
                 pair_groups: int = DEFAULT_GROUPS, composition: str = "basic",
                 resolution: str = "fine", pair_gate: bool = True,
                 missing_cells: bool = True, heaps: bool = True) -> None:
        if not isinstance(schema, Schema):
            raise ValidationError(f"schema must be a Schema, got {type(schema).__name__}")
        #: The table's schema (what fit() reads and sample() returns); ``schema`` is the one
        #: the cells follow (:mod:`dpfed.common.synth.missing_cells`).
        self.output_schema = schema
        self.schema = self._cells_schema(schema, bool(missing_cells), links, continuous_link,
                                         continuous_scaling)
        schema = self.schema
        self.epsilon = check_epsilon(epsilon)
        self.delta = check_delta(delta)
        self.mode = check_choice(mode, "mode", MODES)
        self.continuous_scaling = check_choice(continuous_scaling, "continuous_scaling",
                                               CONTINUOUS_SCALINGS)
        self.continuous_link = check_choice(continuous_link, "continuous_link",
                                            CONTINUOUS_LINKS)
        self.n_bins = check_int(n_bins, "n_bins", minimum=2, maximum=SYNTH_MAX_BINS)
        self.resolution = check_resolution(resolution)
        self.pair_gate = bool(pair_gate)
        self.heaps = bool(heaps)
        dim = latent_dim(schema)
        self.rank = None if rank is None else check_int(rank, "rank", minimum=1, maximum=dim)
        self.info_threshold = check_probability(info_threshold, "info_threshold")
        self.max_rank = None if max_rank is None else check_int(max_rank, "max_rank",
                                                                minimum=1)
        self.pairs = self._check_pairs(pairs, links, budget_split)
        self.pair_groups = check_int(pair_groups, "pair_groups", minimum=2,
                                     maximum=MAX_GROUPS)
        self.budget_split = _budget_split(self.mode, budget_split, self.pairs > 0)
        self.clip_norm = (default_clip_norm(dim) if clip_norm is None
                          else check_positive(clip_norm, "clip_norm"))
        self.min_proportion = check_nonnegative(min_proportion, "min_proportion")
        self.rescale_latent = bool(rescale_latent)
        self.residual = bool(residual)
        self.correct_correlation = bool(correct_correlation)
        self.n_simulations = (None if n_simulations is None
                              else check_int(n_simulations, "n_simulations", minimum=100))
        self.loading_noise_epsilon = (None if loading_noise_epsilon is None
                                      else check_epsilon(loading_noise_epsilon,
                                                         "loading_noise_epsilon"))
        self.pca_calibration = check_choice(pca_calibration, "pca_calibration",
                                            ("analytic", "classic"))
        self.composition = check_choice(composition, "composition", COMPOSITIONS)
        if self.composition == "zcdp" and (self.mode != "generative"
                                           or self.continuous_scaling != "dp"
                                           or self.pca_calibration != "analytic"):
            raise ValidationError("composition='zcdp' needs Gaussian releases only: "
                                  "mode='generative', continuous_scaling='dp' and "
                                  "pca_calibration='analytic'")
        self.row_policy = row_policy
        if links is not None and (not isinstance(links, LatentLinks)
                                  or links.schema.digest() != schema.digest()):
            raise ValidationError("links must be LatentLinks built for this schema")
        if subspace is not None:
            if hasattr(subspace, "feature_names_in_"):
                raise ValidationError(
                    "subspace is a `pca` job result: it lives in the feature space (columns "
                    "scaled by their bounds, nominal columns one-hot), not in the synthesizer's "
                    "latent space (link coordinates); run `dpfed synth` (its DP-PCA round is in "
                    "the latent space) or pass a PCAEstimate of unit-ball latent rows together "
                    "with the links= it was computed with")
            if not isinstance(subspace, PCAEstimate):
                raise ValidationError(
                    f"subspace must be a PCAEstimate, got {type(subspace).__name__}")
            if subspace.components.ndim != 2 or subspace.components.shape[1] != dim:
                raise ValidationError(
                    f"subspace components must be K x {dim} (the latent dimension), got "
                    f"{subspace.components.shape}")
            if self.rank is not None and self.rank > subspace.components.shape[0]:
                raise ValidationError(
                    f"rank {self.rank} exceeds the {subspace.components.shape[0]} components "
                    "of the given subspace")
            if links is None:
                raise ValidationError(
                    "subspace needs links=: a DP subspace has a meaning only in the latent space "
                    "(and scaling) of the links it was computed with; links fitted anew here "
                    "would give another space")
        self.subspace = subspace
        self.links = links
        if self.mode == "generative" and self.continuous_scaling == "bounds" and any(
                isinstance(c, ContinuousColumn) for c in schema.columns):
            raise ValidationError(
                "mode='generative' needs continuous_scaling='dp': it samples a centred latent, "
                "and 'bounds' scaling does not release the continuous columns' means")
        self._rng = resolve_rng(rng)
        self._factors: np.ndarray | None = None
        self.proportions_: np.ndarray | None = None
        self._fitted = False

    @staticmethod
    def _cells_schema(schema: Schema, missing_cells: bool, links: LatentLinks | None,
                      continuous_link: str, continuous_scaling: str) -> Schema:
        """Return the schema the cells follow: a missing cell per "category" column if asked.

        Given ``links`` decide by the schema they were built for. Only the quantile link
        (with ``continuous_scaling='dp'``) can carry a continuous column's missing cell.
        """
        cells = synth_schema(schema, missing_cells)
        if links is not None and isinstance(links, LatentLinks):
            return cells if links.schema.digest() == cells.digest() else schema
        absent = [c.name for c in schema.columns if isinstance(c, ContinuousColumn)
                  and c.missing == "category"]
        if cells is not schema and absent and (continuous_link != "quantile"
                                               or continuous_scaling != "dp"):
            raise ValidationError(
                f"missing_cells=True: the missing values of {absent} (missing = \"category\") "
                "need continuous_link='quantile' and continuous_scaling='dp'; or pass "
                "missing_cells=False to model them as their fill value")
        return cells

    def _check_pairs(self, pairs: int | None, links: LatentLinks | None,
                     split: Mapping[str, float] | None) -> int:
        """Resolve ``pairs``: its default, or refuse it where no pair table can be fitted."""
        n_columns = len(self.schema.columns)
        possible = (self.mode == "generative" and self.continuous_scaling == "dp"
                    and links is None and n_columns >= 2)
        if pairs is None:
            # A split written without the pair releases keeps meaning what it meant.
            named = split is None or any(k in split for k in ("pair_scores", "pairs"))
            return n_columns - 1 if possible and named else 0
        chosen = check_int(pairs, "pairs", minimum=0)
        if chosen > 0 and not possible:
            raise ValidationError(
                f"pairs={chosen}: DP pair tables need mode='generative', "
                "continuous_scaling='dp', links fitted here (no links=) and at least two "
                "columns; pass pairs=0")
        return chosen

    # ------------------------------------------------------------------ budget
    def _needed(self) -> dict[str, bool]:
        return {
            "marginals": self.links is None and needs_link_statistics(self.schema,
                                                                      self.continuous_scaling),
            "pca": self.subspace is None,
            "factors": self.mode == "row_aligned",
            "pair_scores": self.pairs > 0,
            "pairs": self.pairs > 0,
        }

    def _allocation(self) -> dict[str, float]:
        needed = self._needed()
        weights = {k: self.budget_split.get(k, 0.0) for k in BUDGET_PARTS if needed[k]}
        for key, w in weights.items():
            if w <= 0.0:
                raise ValidationError(
                    f"budget_split gives no epsilon to {key!r}, which this run needs")
        total = sum(weights.values())
        return {k: self.epsilon * w / total for k, w in weights.items()}

    def _delta_allocation(self) -> dict[str, float]:
        """Delta of each Gaussian release: the job's delta shares over the ones this run makes.

        The link histograms (``continuous_scaling="dp"``), the DP-PCA and the two pair
        releases are Gaussian; the "bounds" marginals and the row-aligned factors are pure
        epsilon-DP (no delta).
        """
        needed = self._needed()
        gaussian = {"marginals": needed["marginals"] and self.continuous_scaling == "dp",
                    "pca": needed["pca"], "pair_scores": needed["pair_scores"],
                    "pairs": needed["pairs"]}
        job = _job_shares(self.mode, self.pairs > 0)
        shares = {k: job[k][1] for k, g in gaussian.items() if g}
        total = sum(shares.values())
        return {k: self.delta * w / total for k, w in shares.items()}

    # ------------------------------------------------------------------ fit
    def _fit_links(self, table: EncodedTable, epsilon: float | None, delta: float | None,
                   costs: dict[str, PrivacyCost]) -> LatentLinks:
        """Link round: the job's Gaussian histograms ("dp") or the public-bounds links."""
        if self.links is not None:
            return self.links  # DP links fitted elsewhere (e.g. the federated link round)
        rng = self._rng
        if self.continuous_scaling == "dp":
            assert epsilon is not None and delta is not None
            acc = LinkHistogramAccumulator(self.schema, self.n_bins, self.resolution)
            acc.add(table)
            noisy = release_link_histograms(acc.counts, self.schema, self.n_bins, epsilon=epsilon,
                                            delta=delta, rng=rng, resolution=self.resolution)
            costs["marginals"] = link_round_cost(self.schema, epsilon, delta)
            sigma = link_histogram_mechanism(self.schema, epsilon, delta).sigma
            proportions, links = links_from_histograms(
                noisy, self.schema, self.n_bins, n_rows=table.n_rows,
                continuous_link=self.continuous_link, min_proportion=self.min_proportion,
                resolution=self.resolution, heaps=self.heaps,
                noise_sd=release_noise_sd(self.schema, self.n_bins, sigma, self.resolution))
            self.proportions_ = proportions
            return links
        # "bounds" (row-aligned only): continuous columns scaled by the public bounds, DP
        # histograms of the categorical columns only.
        release = None
        if epsilon is not None:
            release, costs["marginals"] = fit_link_statistics(
                table, epsilon=epsilon, rng=rng, continuous_scaling="bounds")
        return combine_link_statistics(self.schema, release, continuous_scaling="bounds",
                                       min_proportion=self.min_proportion)

    def fit(self, data: Any) -> FactorModelSynthesizer:
        """Encode ``data`` (DataFrame or Arrow table), make every DP release, keep the model.

        The coordinator steps are those of the federated ``synth`` job
        (:mod:`dpfed.common.synth.pipeline`), with this table as the only site.

        Raises
        ------
        DataError
            Missing schema columns, rows that break an "error" row policy, or no rows left.
        """
        encoded, report = encode_table(self.output_schema, data, policy=self.row_policy)
        table = to_cells_table(encoded, self.schema)
        if table.n_rows == 0:
            raise DataError("no rows left to fit after encoding (see the encoding report)")
        budget = self._allocation()
        deltas = self._delta_allocation()
        if self.composition == "zcdp":
            shares = [(k, budget[k] / self.epsilon, deltas[k] / self.delta) for k in budget]
            plan = split_budget(self.epsilon, self.delta, shares, "zcdp")
            budget = {k: e for k, e, _ in plan}
            deltas = {k: d for k, _, d in plan}
        rng = self._rng
        costs: dict[str, PrivacyCost] = {}
        self.proportions_ = None
        # Alg. 2 step 1: the links from DP statistics (site release + coordinator step).
        links = self._fit_links(table, budget.get("marginals"), deltas.get("marginals"), costs)
        # Alg. 2 steps 1-2: latent rows, clipped into the unit ball with the public bound.
        unit, n_clipped = clip_to_unit_ball(links.to_latent(table, rng), self.clip_norm)
        # Alg. 1 step 1: the DP second moment, from DP-PCA (or given).
        if self.subspace is None:
            estimate, costs["pca"] = central_dp_pca(unit, epsilon=budget["pca"],
                                                    delta=deltas["pca"], rng=rng,
                                                    calibration=self.pca_calibration)
        else:
            estimate = self.subspace
        generative = self.mode == "generative"
        # The factor model (generative: of the corrected latent correlation).
        model, corr = fit_factor_model(
            estimate, links, clip_norm=self.clip_norm, rng=rng, rank=self.rank,
            info_threshold=self.info_threshold, max_rank=self.max_rank,
            correct_correlation=generative and self.correct_correlation,
            residual=self.residual and generative, rescale=self.rescale_latent,
            n_simulations=self.n_simulations, n_rows=table.n_rows)
        loadings = model.loadings
        if self.loading_noise_epsilon is not None:
            # Alg. 1 step 2 on DP loadings: post-processing, no budget (see perturb_loadings).
            loadings = perturb_loadings(loadings, epsilon=self.loading_noise_epsilon, rng=rng,
                                        eigenvalues=model.eigenvalues)
            model = build_factor_model(links, loadings, model.eigenvalues,
                                       clip_norm=self.clip_norm, residual=model.residual,
                                       rescale=self.rescale_latent)
        self._factors = None
        if not generative:
            # Alg. 1 step 3 (corrected): every entry of C is Lap(2 sqrt(r) / epsilon_2).
            self._factors, costs["factors"] = factor_release(unit, loadings,
                                                             epsilon=budget["factors"], rng=rng)
            model = row_aligned_model(links, loadings, model.eigenvalues,
                                      clip_norm=self.clip_norm,
                                      noise_scale=costs["factors"].noise_scale,
                                      rescale=self.rescale_latent)
        # The final calibration: every synthetic column reproduces its released DP marginal.
        self.decode_links_, _ = calibrated_links(links, model, rng, self._factors,
                                                 n_rows=table.n_rows)
        # The job's pair rounds and the correction of generated rows to their tables.
        self.pair_grid_: PairGrid | None = None
        self.pair_edges_: list[Pair] = []
        self.pair_correction_: PairCorrection | None = None
        if self.pairs > 0:
            self._fit_pairs(table, model, budget, deltas, costs)
        self.model_ = model
        self.links_ = links
        self.components_ = np.ascontiguousarray(loadings.T)
        self.eigenvalues_ = model.eigenvalues
        self.rank_ = model.rank
        self.residual_variance_ = model.residual
        self.latent_correlation_ = corr
        self.clip_norm_ = self.clip_norm
        self.n_rows_ = table.n_rows
        self.n_clipped_ = n_clipped
        self.encoding_report_: EncodingReport = report
        self.budget_ = budget
        self.delta_budget_ = deltas
        self.privacy_costs_ = costs
        total = PrivacyCost.total(costs.values())
        if self.composition == "zcdp":
            total = PrivacyCost(zcdp_to_epsilon(total.rho, self.delta), self.delta, total.rho,
                                "composed-zcdp")
        self.privacy_cost_ = total
        self._fitted = True
        return self

    def _fit_pairs(self, table: EncodedTable, model: FactorModel, budget: dict[str, float],
                   deltas: dict[str, float], costs: dict[str, PrivacyCost]) -> None:
        """Make the ``pair_scores`` and ``pairs`` releases and their post-processing.

        The site steps of the job's two rounds on this table (every candidate pair's
        dependence score, then the chosen pairs' tables, each with Gaussian noise) and its
        coordinator steps (:func:`dpfed.common.synth.pipeline.pair_forest` and
        :func:`dpfed.common.synth.pipeline.fit_pairs`).
        """
        proportions = self.proportions_
        assert proportions is not None  # pairs > 0 only with links fitted here ("dp")
        rng = self._rng
        grid = PairGrid.from_proportions(self.schema, proportions, self.n_bins,
                                         self.pair_groups, self.resolution)
        candidates = grid.candidate_pairs()
        if not candidates:
            log.info("[FactorModelSynthesizer._fit_pairs] no pair table of at most %d cells: "
                     "the pair releases are skipped", MAX_PAIR_CELLS)
            return
        acc = PairTableAccumulator(grid, candidates)
        acc.add(table)
        scores = dependence_scores(acc.counts, grid, candidates, proportions, table.n_rows)
        score_mech = score_mechanism(len(candidates), budget["pair_scores"],
                                     deltas["pair_scores"])
        noisy_scores = score_mech.release(scores, rng)
        costs["pair_scores"] = score_mech.cost()
        edges = pair_forest(noisy_scores, grid, self.pairs, None if not self.pair_gate else (
            lambda k: pair_table_mechanism(k, budget["pairs"], deltas["pairs"]).sigma))
        if not edges:
            log.info("[FactorModelSynthesizer._fit_pairs] no pair's score is above the noise "
                     "its table would carry: the pairs release is skipped")
            return
        tables = PairTableAccumulator(grid, edges)
        tables.add(table)
        table_mech = pair_table_mechanism(len(edges), budget["pairs"], deltas["pairs"])
        noisy_tables = table_mech.release(tables.counts, rng)
        costs["pairs"] = table_mech.cost()
        self.pair_correction_ = fit_pairs(noisy_tables, grid, edges, proportions,
                                          n_rows=table.n_rows, model=model,
                                          decode=self.decode_links_, rng=rng,
                                          noise_sd=table_mech.sigma)
        self.pair_grid_ = grid
        self.pair_edges_ = edges
        log.info("[FactorModelSynthesizer._fit_pairs] %d of %d candidate pairs measured: %s",
                 len(edges), len(candidates), edges)

    @property
    def privacy_cost_replace_one_(self) -> PrivacyCost:
        """The total under replace-one: the same as :attr:`privacy_cost_`.

        Every release is calibrated to replace-one (docs/privacy.md), so no conversion is
        needed. Kept for callers written when the marginals and the PCA were calibrated to
        add/remove-one and this property doubled them (docs/release-notes.md).
        """
        self._check_fitted()
        return self.privacy_cost_

    def _check_fitted(self) -> None:
        if not self._fitted:
            raise ValidationError("call fit() before sample()")

    # ------------------------------------------------------------------ sample
    def sample_encoded(self, n: int | None = None) -> EncodedTable:
        """Like :meth:`sample` but return the :class:`~dpfed.common.data.encoding.EncodedTable`."""
        self._check_fitted()
        if self.mode == "row_aligned":
            if n is not None and n != self.n_rows_:
                raise ValidationError(
                    f"mode='row_aligned' releases one synthetic row per real row: n must be "
                    f"None or {self.n_rows_}, got {n!r}")
            assert self._factors is not None
            return from_cells_table(self.decode_links_.from_latent(
                aligned_latent(self._factors, self.model_)), self.output_schema)
        rows = self.n_rows_ if n is None else check_int(n, "n", minimum=0)
        correction = self.pair_correction_
        parts = list(iter_samples(self.model_, self.decode_links_, rows, self._rng,
                                  correct=None if correction is None else partial(
                                      correction.apply, in_place=True)))
        if not parts:
            parts = [self.decode_links_.from_latent(np.zeros((0, self.decode_links_.dim)))]
        return from_cells_table(EncodedTable.concatenate(parts), self.output_schema)

    def sample(self, n: int | None = None) -> pd.DataFrame:
        """Return a synthetic DataFrame with the schema's types.

        Continuous columns are floats within the schema bounds; ordinal and nominal columns
        are pandas Categoricals with the schema's labels (ordered for ordinal). ``n`` defaults
        to the number of training rows; row-aligned mode always returns that many (the same
        table on every call: its only randomness is the DP release made by :meth:`fit`).
        """
        return self.sample_encoded(n).to_frame()

