"""The ``synth`` job's two sums under secure aggregation (``--aggregation secure``).

``links``
    One secure ``counts`` sum of the sites' exact per-column histograms (source
    ``synth_counts``): the coordinator decodes the pooled counts plus one Skellam draw per cell
    and builds the links from them exactly as from the sum of site-level DP histograms.
``pca``
    One secure ``gram`` sum of the sites' unit-ball latent rows under those links (source
    ``synth_latent``; every site checks the links' digest): the coordinator decodes ``G``,
    divides by the public pooled row count and eigendecomposes ``G / N`` into the
    :class:`~dpfed.common.pca.dppca.PCAEstimate` the factor model is fitted from.
``pair_scores``
    One secure ``scores`` sum of the sites' floored dependence scores of every candidate
    column pair (source ``synth_pair_scores``; links digest checked): the coordinator decodes
    the pooled scores plus one Skellam draw per pair and chooses the pairs from them.
``pairs``
    One secure ``counts`` sum of the sites' exact 2-way tables of the chosen edges (source
    ``synth_pairs``; every site validates the edges): the coordinator decodes the pooled
    tables, concatenated in edge order.

Privacy
-------
Replace-one at one site; each sum's noise is calibrated to one row of the *pooled* data (see
:mod:`dpfed.common.secagg.secure_sum`): counts with L2 ``sqrt(2 C)`` and L1 ``2 C`` for ``C``
columns at scale 1; the Gram of unit-ball rows with L2 ``sqrt(2) B^2`` at the plan's scale;
the ``P`` floored dependence scores, each moving by at most 2, with L2 ``2 sqrt(P)`` and L1
``2 P`` at scale 1 (``row_norm`` 2, the per-entry bound); the ``K`` edges' tables as counts
with ``C = K`` (L2 ``sqrt(2 K)``, L1 ``2 K``).
Every site is charged the round's ``(epsilon, delta)`` -- under ``--composition zcdp`` the
epsilon of the sum's plan, which spends at most the round's rho share (:func:`rho_share`) --
and the coordinator learns the noisy pooled totals, the participants and their public row
counts. Everything after the decode is post-processing.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.aggregator.jobs.base import JobContext
from dpfed.aggregator.jobs.pca_secure import decompose_second_moment
from dpfed.aggregator.jobs.secure_rounds import (
    SecureSumOutcome,
    secure_sum,
    symmetric_from_upper,
)
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.pca.dppca import PCAEstimate
from dpfed.common.privacy.composition import round_rho
from dpfed.common.privacy.skellam import skellam_calibrate
from dpfed.common.synth.link_release import (
    histogram_sizes,
    secure_link_row_norm,
    secure_link_weights,
    secure_pooled_counts,
)
from dpfed.common.synth.links import latent_dim
from dpfed.common.synth.pair_marginals import SCORE_SENSITIVITY, Pair, PairGrid, check_pairs

#: What each secure round of the synth job releases (report and metadata wording).
SECURE_SYNTH_ROUNDS = {
    "links": "a masked exact count vector (every column's histogram) with a share of Skellam "
             "noise; only the pooled total is decoded -> the DP marginals and the links",
    "pca": "a masked integer Gram matrix of the unit-ball latent rows with a share of Skellam "
           "noise; only the pooled total is decoded -> G / N and its eigenvectors",
    "pair_scores": "a masked integer vector of floored dependence scores (one per candidate "
                   "column pair) with a share of Skellam noise; only the pooled total is "
                   "decoded -> the chosen pairs",
    "pairs": "a masked exact count vector (the chosen pairs' 2-way tables) with a share of "
             "Skellam noise; only the pooled total is decoded -> the DP pair tables",
}


def counts_sigma(groups: int, epsilon: float, delta: float) -> float:
    """Return the Skellam noise's standard deviation on every cell of a secure counts sum.

    ``groups`` is the number ``C`` of histograms (or tables) every row adds one count to:
    one replaced row moves one count down and another up in each, so L2 sensitivity
    ``sqrt(2 C)`` and L1 ``2 C`` (budget checks before anything runs).
    """
    return math.sqrt(skellam_calibrate(epsilon, delta, math.sqrt(2.0 * groups),
                                       2.0 * groups).mu)


def pooled_counts_sigma(schema: Schema, n_bins: int, epsilon: float,
                        delta: float, resolution: str = "bins") -> np.ndarray:
    """Return the Skellam noise's standard deviation on each column's pooled counts.

    The secure link round sums weighted counts (``m_j`` per row in column ``j``, L2
    sensitivity ``sqrt(2) row_norm``, L1 bounded by ``2 row_norm^2``) and divides column
    ``j`` by ``m_j``: ``sqrt(mu) / m_j`` (budget checks before anything runs).
    """
    # the weighted_counts plan's sensitivities are those of counts with C = row_norm^2 groups
    groups = round(secure_link_row_norm(schema, n_bins, resolution) ** 2)
    return np.asarray(counts_sigma(groups, epsilon, delta)
                      / secure_link_weights(schema, n_bins, resolution))


def rho_share(params: SynthParams, epsilon: float, delta: float) -> float | None:
    """Return the rho a secure round may be charged: its share under zCDP, else None.

    Under ``--composition zcdp`` the round's ``(epsilon, delta)`` is the analytic Gaussian's for
    its rho share, and the sum is planned to spend that rho
    (:func:`dpfed.common.secagg.secure_sum.plan_within_rho`); under basic composition it is
    calibrated to ``(epsilon, delta)`` itself.
    """
    return round_rho(epsilon, delta) if params.composition == "zcdp" else None


@dataclass(frozen=True)
class SecureLinks:
    """The decoded noisy pooled counts (divided by the column weights) and the secure sum."""

    counts: np.ndarray
    outcome: SecureSumOutcome


async def secure_links(ctx: JobContext, *, schema: Schema, params: SynthParams,
                       base: dict[str, Any], epsilon: float, delta: float,
                       rho: float | None = None) -> SecureLinks:
    """Round ``links``: the secure sum of every site's exact per-column count vector."""
    size = sum(histogram_sizes(schema, params.n_bins, params.resolution))
    out = await secure_sum(
        ctx, name="links", statistic="weighted_counts", dim=size,
        site_params={"source": "synth_counts", "job": base["job"],
                     "schema_digest": base["schema_digest"]},
        epsilon=epsilon, delta=delta,
        row_norm=secure_link_row_norm(schema, params.n_bins, params.resolution),
        progress=(0.05, 0.3), require_kind="synth", rho=rho)
    return SecureLinks(secure_pooled_counts(out.value, schema, params.n_bins, params.resolution),
                       out)


async def secure_latent_pca(ctx: JobContext, *, schema: Schema, base: dict[str, Any],
                            digest: str, proportions: np.ndarray, epsilon: float,
                            delta: float, among: list[str], rho: float | None = None
                            ) -> tuple[PCAEstimate, SecureSumOutcome]:
    """Round ``pca``: the secure Gram sum of the unit-ball latent rows; all p eigenpairs.

    Only the sites in ``among`` (those whose counts built the links) take part.
    """
    dim = latent_dim(schema)
    out = await secure_sum(
        ctx, name="pca", statistic="gram", dim=dim,
        site_params={"source": "synth_latent", "job": base["job"],
                     "schema_digest": base["schema_digest"], "links_digest": digest},
        epsilon=epsilon, delta=delta, row_norm=1.0,
        arrays={"link_proportions": proportions}, progress=(0.35, 0.7), require_kind="synth",
        among=among, rho=rho)
    a = symmetric_from_upper(out.value, dim) / out.n_rows_total
    estimate = await asyncio.to_thread(decompose_second_moment, a, dim)
    return estimate, out


def _pair_grid(schema: Schema, base: dict[str, Any], proportions: np.ndarray,
               pair_groups: int) -> PairGrid:
    """Return the grid every site rebuilds from the same links and ``pair_groups``."""
    params = SynthParams.from_mapping(dict(base["job"]), latent_dim=latent_dim(schema))
    return PairGrid.from_proportions(schema, proportions, params.n_bins, pair_groups,
                                     params.resolution)


def _pair_site_params(source: str, base: dict[str, Any], digest: str,
                      pair_groups: int) -> dict[str, Any]:
    return {"source": source, "job": base["job"], "schema_digest": base["schema_digest"],
            "links_digest": digest, "pair_groups": int(pair_groups)}


async def secure_pair_scores(ctx: JobContext, *, schema: Schema, base: dict[str, Any],
                             digest: str, proportions: np.ndarray, pair_groups: int,
                             epsilon: float, delta: float, among: list[str],
                             rho: float | None = None) -> tuple[np.ndarray, SecureSumOutcome]:
    """Round ``pair_scores``: the secure sum of every site's floored dependence scores.

    Returns the decoded noisy pooled scores (float64, one per pair of
    :meth:`~dpfed.common.synth.pair_marginals.PairGrid.candidate_pairs`, in that order) and
    the outcome. Only the sites in ``among`` (those whose counts built the links) take part.

    Raises
    ------
    ValidationError
        The schema has no candidate pair (the caller skips the pair rounds then).
    """
    cands = _pair_grid(schema, base, proportions, pair_groups).candidate_pairs()
    if not cands:
        raise ValidationError("no candidate column pair: the pair rounds have nothing to score")
    out = await secure_sum(
        ctx, name="pair_scores", statistic="scores", dim=len(cands),
        site_params=_pair_site_params("synth_pair_scores", base, digest, pair_groups),
        epsilon=epsilon, delta=delta, row_norm=SCORE_SENSITIVITY,
        arrays={"link_proportions": proportions}, progress=(0.74, 0.8), require_kind="synth",
        among=among, rho=rho)
    return np.asarray(out.value, dtype=np.float64), out


async def secure_pair_tables(ctx: JobContext, *, schema: Schema, base: dict[str, Any],
                             digest: str, proportions: np.ndarray, pair_groups: int,
                             edges: list[Pair], epsilon: float, delta: float,
                             among: list[str], rho: float | None = None
                             ) -> tuple[np.ndarray, SecureSumOutcome]:
    """Round ``pairs``: the secure sum of every site's exact tables of the chosen ``edges``.

    Returns the decoded noisy pooled tables (float64, each edge's ``(parent, child)`` table
    flattened parent-major, concatenated in edge order) and the outcome.
    """
    grid = _pair_grid(schema, base, proportions, pair_groups)
    checked = check_pairs(edges, len(schema.columns))
    if not checked:
        raise ValidationError("the pairs round needs at least one edge")
    out = await secure_sum(
        ctx, name="pairs", statistic="counts", dim=sum(grid.cells(e) for e in checked),
        site_params={**_pair_site_params("synth_pairs", base, digest, pair_groups),
                     "pair_edges": [[int(a), int(b)] for a, b in checked]},
        epsilon=epsilon, delta=delta, row_norm=math.sqrt(len(checked)),
        arrays={"link_proportions": proportions}, progress=(0.8, 0.88), require_kind="synth",
        among=among, rho=rho)
    return np.asarray(out.value, dtype=np.float64), out


def secure_metadata(rounds: dict[str, SecureSumOutcome]) -> dict[str, Any]:
    """Return the model's ``secure`` metadata: per round participants, t, noise, guarantee."""
    out: dict[str, Any] = {"mechanism": "skellam", "rounds": {}}
    for name, o in rounds.items():
        plan = o.plan
        out["rounds"][name] = {
            "statistic": plan.statistic, "participants": list(plan.participants),
            "tolerated_colluders": plan.tolerated, "attempts": o.attempts,
            "epsilon": plan.calibration.epsilon, "delta": plan.calibration.delta,
            "noise_variance_integer": plan.mu_total, "scale": plan.scale,
            "l2_sensitivity_integer": plan.calibration.l2_sensitivity,
            "l1_sensitivity_integer": plan.calibration.l1_sensitivity,
            "n_rows_total": o.n_rows_total, "releases": SECURE_SYNTH_ROUNDS.get(name, "")}
    last = rounds[list(rounds)[-1]].plan
    out["participants"] = list(last.participants)
    out["tolerated_colluders"] = max(o.plan.tolerated for o in rounds.values())
    out["guarantee"] = (
        "each site's rows are protected by (epsilon, delta) per round against the coordinator, "
        "which saw only the noisy pooled sums, and against up to "
        f"{out['tolerated_colluders']} colluding part(ies) (the coordinator included); the "
        "noise is calibrated to one row of the pooled data")
    return out
