"""The coordinator steps of DP factor-model synthesis, shared by every entry point.

The federated ``synth`` job (:mod:`dpfed.aggregator.jobs.synth`), the model file
(:class:`dpfed.aggregator.synth_model.SynthModel`) and the central library class
(:class:`dpfed.common.synth.factor_model.FactorModelSynthesizer`) run the same steps through
these functions, so a central fit and a federated fit differ only in who released the noisy
statistics:

1. :func:`links_from_histograms` -- summed DP histograms -> DP proportions -> links;
2. :func:`combine_factors` -- the sites' DP-PCA factors -> one estimate (size weighted);
3. :func:`dpfed.common.synth.generative.fit_factor_model` (generative, with the correlation
   correction) or :func:`row_aligned_model` (row-aligned) -- the factor model;
4. :func:`calibrated_links` -- the final per-column calibration: decoding links under which
   the model's latent reproduces every released DP marginal (exactly in distribution for
   ordinal and quantile-linked columns of a generative model);
5. generative mode with DP pair tables (:mod:`dpfed.common.synth.pair_marginals`):
   :func:`pair_forest` -- the summed noisy dependence scores -> the pairs to measure;
   :func:`fit_pairs` -- the summed noisy pair tables -> the correction of generated rows
   (:func:`pair_correction` when the tables are already fitted).

Privacy: every function here is post-processing of DP releases and of the public row counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.dppca import PCAEstimate, combine, site_weights
from dpfed.common.synth.generative import (
    FactorModel,
    build_factor_model,
    calibrate_proportions,
    calibration_rows,
    decoding_links,
)
from dpfed.common.synth.link_release import links_from_proportions, proportions_from_histograms
from dpfed.common.synth.links import LatentLinks, NominalLink
from dpfed.common.synth.pair_marginals import (
    Pair,
    PairCorrection,
    PairGrid,
    choose_forest,
    fit_pair_tables,
)
from dpfed.common.validation import check_finite_array, check_nonnegative

#: How the sites' DP-PCA factors are weighted when combined (public row counts).
FACTOR_WEIGHTING = "size"


def links_from_histograms(total: np.ndarray, schema: Schema, n_bins: int, *, n_rows: float,
                          continuous_link: str = "quantile",
                          min_proportion: float = 1e-4, resolution: str = "bins",
                          noise_sd: np.ndarray | None = None, heaps: bool = False
                          ) -> tuple[np.ndarray, LatentLinks]:
    """Turn summed DP histograms into (DP proportions, links) (post-processing).

    ``n_rows`` is the public pooled row count: every column's block is projected onto the
    counts that sum to it (under ``resolution="fine"`` a continuous column is estimated from
    its coarse and leaf counts with their public noise ``noise_sd``) before the proportions
    are floored (:func:`dpfed.common.synth.link_release.proportions_from_histograms`;
    ``heaps`` as there).
    """
    proportions = proportions_from_histograms(total, schema, n_bins,
                                              min_proportion=min_proportion, n_rows=n_rows,
                                              resolution=resolution, noise_sd=noise_sd,
                                              heaps=heaps)
    return proportions, links_from_proportions(schema, proportions, n_bins, continuous_link,
                                               resolution)


def combine_factors(factors: Sequence[np.ndarray], n_rows: Sequence[int],
                    dim: int) -> PCAEstimate:
    """Combine the sites' DP-PCA factors, weighted by their public row counts ``N_s / N``.

    Every site releases the factor of its own normalised second moment ``G_s / N_s``; the
    pooled second moment is ``sum_s (N_s / N) G_s / N_s``, so size weights make the combined
    estimate the pooled one whatever the sites' sizes (equal weights over-represent small
    sites). Post-processing of the releases and of the public ``N_s``.
    """
    if len(factors) != len(n_rows):
        raise ValidationError(f"{len(factors)} factors but {len(n_rows)} row counts")
    weights = site_weights([int(n) for n in n_rows], FACTOR_WEIGHTING)
    return combine(list(factors), dim, list(weights))


def row_aligned_model(links: LatentLinks, loadings: np.ndarray, eigenvalues: np.ndarray, *,
                      clip_norm: float, noise_scale: float, rescale: bool = True) -> FactorModel:
    """Return the row-aligned decoding model (loadings, eigenvalues, noise-aware multiplier).

    The factor rows carry Laplace noise of scale ``noise_scale`` (variance ``2 b^2`` per
    entry) and no residual; the multiplier gives every coordinate its modelled variance.
    """
    b = check_nonnegative(noise_scale, "noise_scale")
    return build_factor_model(links, loadings, eigenvalues, clip_norm=clip_norm, residual=0.0,
                              rescale=rescale, factor_noise_variance=2.0 * b * b,
                              include_residual=False)


def aligned_latent(factors: np.ndarray, model: FactorModel) -> np.ndarray:
    """Latent rows in link units of row-aligned factors: ``W V^T`` times the multiplier."""
    w = check_finite_array(factors, "factors", ndim=2)
    if w.shape[1] != model.rank:
        raise ValidationError(f"factors have {w.shape[1]} columns, the model {model.rank}")
    return np.asarray(w @ (model.loadings.T * model.multiplier[None, :]))


def calibrated_links(links: LatentLinks, model: FactorModel, rng: np.random.Generator,
                     factors: np.ndarray | None = None, *, n_rows: int | None = None
                     ) -> tuple[LatentLinks, list[np.ndarray | None]]:
    """Return the decoding links under which the model reproduces the links' DP marginals.

    Generative models: the latent is exactly ``N(0, covariance)``, so every ordinal and
    quantile-linked column is calibrated exactly from its variance; nominal columns on
    :func:`~dpfed.common.synth.generative.calibration_rows` latent rows drawn from the model
    (``n_rows``: the public row count the releases came from), drawn only when there are
    any. Row-aligned models (``factors`` given) on their own reconstructed latent rows.
    Returns the decoding links and the calibrated proportions per column (None for
    identity-linked continuous columns). Post-processing.
    """
    if factors is not None:
        calibrated = calibrate_proportions(aligned_latent(factors, model), links)
    else:
        nominal = any(isinstance(link, NominalLink) for link in links.links)
        latent = model.latent(calibration_rows(n_rows), rng) if nominal else None
        calibrated = calibrate_proportions(latent, links,
                                           variances=np.diag(model.covariance()))
    return decoding_links(links, calibrated), calibrated


def pair_forest(scores: np.ndarray, grid: PairGrid, max_pairs: int,
                noise: Callable[[int], float] | None = None) -> list[Pair]:
    """Return the (parent, child) pairs to measure from the summed noisy dependence scores.

    ``scores`` are those of ``grid.candidate_pairs()`` (the pairs every site scored), summed
    over the sites; the pairs are a maximum-weight forest of at most ``max_pairs`` edges,
    parents first (:func:`dpfed.common.synth.pair_marginals.choose_forest`).

    ``noise(K)`` (public: the pairs round's calibration) is the standard deviation of the
    summed noise on every cell when ``K`` tables are released. A pair is then measured only
    if its score -- an L1 distance in counts -- exceeds the L1 error its released table
    would carry, ``cells noise(K) sqrt(2/pi)``: a table noisier than the dependence it
    would show only costs the other tables budget. The number of pairs follows (twice: ``K``
    sets the noise, the noise the pairs that pass). Post-processing of the noisy scores.
    """
    pairs = grid.candidate_pairs()
    s = np.asarray(scores, dtype=np.float64)
    d = len(grid.schema.columns)
    if noise is None or not pairs:
        return choose_forest(s, pairs, d, max_pairs)
    cells = np.array([grid.cells(p) for p in pairs], dtype=np.float64)
    k = max(min(max_pairs, len(pairs)), 1)
    keep = np.ones(len(pairs), dtype=bool)
    for _ in range(2):
        keep = s > cells * float(noise(k)) * math.sqrt(2.0 / math.pi)
        k = max(min(len(choose_forest(s[keep], [p for p, ok in zip(pairs, keep, strict=True)
                                                if ok], d, max_pairs)), max_pairs), 1)
    return choose_forest(s[keep], [p for p, ok in zip(pairs, keep, strict=True) if ok], d,
                         max_pairs)


def pair_correction(grid: PairGrid, edges: Sequence[Pair], tables: Sequence[np.ndarray],
                    model: FactorModel, decode: LatentLinks, proportions: np.ndarray,
                    rng: np.random.Generator, *, noise_sd: float = 0.0,
                    n_rows: int | None = None) -> PairCorrection:
    """Fit the correction of generated rows to fitted pair tables (post-processing).

    The correction is built on :func:`~dpfed.common.synth.generative.calibration_rows` rows
    drawn from ``model`` and decoded with the calibrated links ``decode`` (what sampling
    draws before the correction); ``tables`` are the joint proportions of
    :func:`dpfed.common.synth.pair_marginals.fit_pair_tables` and ``noise_sd`` their public
    noise per cell in proportions
    (:meth:`dpfed.common.synth.pair_marginals.PairCorrection.fit`).
    """
    calibration = decode.from_latent(model.latent(calibration_rows(n_rows), rng))
    return PairCorrection.fit(grid, edges, tables, calibration, proportions, rng,
                              noise_sd=noise_sd)


def fit_pairs(total: np.ndarray, grid: PairGrid, edges: Sequence[Pair],
              proportions: np.ndarray, *, n_rows: float, model: FactorModel,
              decode: LatentLinks, rng: np.random.Generator,
              noise_sd: float = 0.0) -> PairCorrection:
    """Turn the summed noisy tables of ``edges`` into the correction of generated rows.

    :func:`dpfed.common.synth.pair_marginals.fit_pair_tables` (projection onto the public
    pooled row count ``n_rows``, raking to the DP 1-way proportions), then
    :func:`pair_correction`; ``noise_sd`` is the public standard deviation of the summed
    noise per cell, in counts (divided by ``n_rows`` here). Post-processing.
    """
    tables = fit_pair_tables(total, grid, edges, proportions, n_rows)
    return pair_correction(grid, edges, tables, model, decode, proportions, rng,
                           noise_sd=float(noise_sd) / max(float(n_rows), 1.0),
                           n_rows=int(n_rows))
