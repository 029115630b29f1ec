"""Coordinator side of the ``synth`` job's pair rounds (generative mode, ``pairs > 0``).

After the ``pca`` round and the factor model's fit:

``pair_scores``
    every site that answered ``pca`` gets the links again (digest checked at the site) and
    releases a noisy dependence score of every candidate column pair
    (:meth:`~dpfed.common.synth.pair_marginals.PairGrid.candidate_pairs`); the coordinator
    sums them and picks a maximum-weight spanning forest of at most ``pairs`` edges
    (:func:`~dpfed.common.synth.pair_marginals.choose_forest`, post-processing).
``pairs``
    every site that answered ``pair_scores`` gets the edges (params ``pair_edges``) and
    releases the noisy 2-way tables of the edges; the coordinator sums them and turns them
    into joint proportions consistent with the public pooled row count and the DP 1-way
    marginals (:func:`~dpfed.common.synth.pair_marginals.fit_pair_tables`).

The caller then fits the model's pair correction to those tables
(:meth:`dpfed.aggregator.synth_model.SynthModel.with_pairs`). With ``aggregation="secure"``
both rounds are secure sums (:func:`secure_pair_scores` and :func:`secure_pair_tables` of
:mod:`dpfed.aggregator.jobs.synth_secure`).

The pair grid is a deterministic function of the DP proportions, and the edges of the
(replayed) noisy scores summed in site order, so a resumed job re-sends identical tasks.
A schema without a candidate pair (every pair's table above
:data:`~dpfed.common.synth.pair_marginals.MAX_PAIR_CELLS` cells) skips both rounds; nothing
is charged for them then.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpfed.aggregator.jobs.base import JobContext
from dpfed.aggregator.jobs.secure_rounds import SecureSumOutcome
from dpfed.aggregator.jobs.synth_secure import (
    counts_sigma,
    rho_share,
    secure_pair_scores,
    secure_pair_tables,
)
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ProtocolError
from dpfed.common.job_params import SynthParams
from dpfed.common.synth.pair_marginals import (
    MAX_PAIR_CELLS,
    Pair,
    PairGrid,
    fit_pair_tables,
    pair_table_mechanism,
)
from dpfed.common.synth.pipeline import pair_forest
from dpfed.common.transport.protocol import TaskResult

log = logging.getLogger(__name__)

#: Largest |value| a noisy pair score or table cell may have (counts of at most ~1e9 rows).
MAX_PAIR_VALUE = 1e12
#: Largest training row count a site may report with a pair release.
MAX_SITE_ROWS = 10**10
#: Most cells of the fitted joint tables the model's metadata keeps for the report.
MAX_REPORTED_CELLS = 20_000


@dataclass
class PairRounds:
    """What the pair rounds produced.

    Attributes
    ----------
    grid : PairGrid
        The cells (from the DP proportions and ``pair_groups``).
    candidates : list of Pair
        The scored pairs, in :meth:`PairGrid.candidate_pairs` order.
    edges : list of Pair
        The chosen (parent, child) edges, parents first.
    tables : list of ndarray
        Per edge, the fitted joint proportions (groups of parent x groups of child).
    sites : list of str
        The sites whose tables were summed (the model's last round).
    n_rows_total : int
        Their public pooled row count.
    noise_sd : float
        Public standard deviation of the noise on every summed cell, in counts (site level:
        ``sqrt(S)`` times one site's Gaussian sigma; secure: the decoded sum's Skellam noise);
        the correction shrinks each table towards the model by it.
    results : dict
        Site-level: round name -> site id -> result ({} under secure aggregation).
    secure : dict
        Secure aggregation: round name -> outcome ({} at site level).
    """

    grid: PairGrid
    candidates: list[Pair]
    edges: list[Pair]
    tables: list[np.ndarray]
    sites: list[str]
    n_rows_total: int
    noise_sd: float
    results: dict[str, dict[str, TaskResult]] = field(default_factory=dict)
    secure: dict[str, SecureSumOutcome] = field(default_factory=dict)

    def metadata(self, schema: Schema) -> dict[str, Any]:
        """Return the model metadata of the pair rounds (edges by index and by column name)."""
        names = schema.names
        out: dict[str, Any] = {
            "pair_edges": [[a, b] for a, b in self.edges],
            "pair_edge_columns": [[names[a], names[b]] for a, b in self.edges],
            "pair_candidates": len(self.candidates),
            "pair_sizes": list(self.grid.sizes),
        }
        if sum(t.size for t in self.tables) <= MAX_REPORTED_CELLS:
            out["pair_tables"] = [np.round(t.ravel(), 8).tolist() for t in self.tables]
        return out


def check_vector(value: Any, size: int, what: str) -> np.ndarray:
    """Return ``value`` if it is a finite float64 vector of ``size`` entries within bounds."""
    if (not isinstance(value, np.ndarray) or value.shape != (size,) or value.dtype != np.float64
            or not np.all(np.isfinite(value))
            or float(np.abs(value).max(initial=0.0)) > MAX_PAIR_VALUE):
        raise ProtocolError(f"expected finite float64 {what} of shape ({size},) with |x| <= "
                            f"{MAX_PAIR_VALUE:g}")
    return value


def _checker(array: str, size: int, what: str) -> Callable[[TaskResult], None]:
    """Return the result check of one pair round: a positive ``n_rows``, the noisy vector."""

    def check(result: TaskResult) -> None:
        n = result.metadata.get("n_rows")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_SITE_ROWS:
            raise ProtocolError(f"result lacks a valid n_rows (1..{MAX_SITE_ROWS:.0e})")
        check_vector(result.arrays.get(array), size, what)

    return check


def pair_noise(params: SynthParams, epsilon: float, delta: float,
               n_sites: int) -> Callable[[int], float]:
    """Return ``K -> `` the summed noise's standard deviation per cell of ``K`` pair tables.

    Public: the pairs round's calibration (site level: ``sqrt(S)`` times one site's Gaussian
    sigma; secure: the Skellam sum's, at the round's (epsilon, delta)).
    """
    if params.aggregation == "secure":
        return lambda k: counts_sigma(k, epsilon, delta)
    return lambda k: pair_table_mechanism(k, epsilon, delta).sigma * math.sqrt(n_sites)


def plan_pairs(schema: Schema, params: SynthParams, proportions: np.ndarray
               ) -> tuple[PairGrid, list[Pair], int] | None:
    """Return (grid, candidates, most edges), or None when the pair rounds do not apply."""
    most = params.max_pairs(len(schema.columns))
    if not params.pair_rounds or most == 0:
        return None
    grid = PairGrid.from_proportions(schema, proportions, params.n_bins, params.pair_groups,
                                     params.resolution)
    candidates = grid.candidate_pairs()
    if not candidates:
        log.info("[synth_pairs.plan_pairs] no pair table has at most %d cells; pair rounds "
                 "skipped", MAX_PAIR_CELLS)
        return None
    return grid, candidates, most


async def run_pair_rounds(ctx: JobContext, *, schema: Schema, params: SynthParams,
                          proportions: np.ndarray, digest: str, base: dict[str, Any],
                          secure_base: dict[str, Any], budget: dict[str, tuple[float, float]],
                          among: list[str], kind: str) -> PairRounds | None:
    """Run ``pair_scores`` then ``pairs`` among the sites of the round before (module doc).

    ``base`` / ``secure_base`` are the site-level and secure task parameters of the job,
    ``among`` the sites that answered ``pca``. Returns None when the rounds are skipped.
    """
    planned = plan_pairs(schema, params, proportions)
    if planned is None:
        ctx.emit("pairs", "pair rounds skipped (no column pair has a small enough table)",
                 0.74)
        return None
    grid, candidates, most = planned
    secure = params.aggregation == "secure"
    eps_s, delta_s = budget["pair_scores"]
    eps_t, delta_t = budget["pairs"]
    link_arrays = {"link_proportions": proportions}
    out_results: dict[str, dict[str, TaskResult]] = {}
    outcomes: dict[str, SecureSumOutcome] = {}
    ctx.emit("pair_scores", f"scoring {len(candidates)} column pair(s) at {len(among)} "
             "site(s)", 0.74)
    if secure:
        raw, outcomes["pair_scores"] = await secure_pair_scores(
            ctx, schema=schema, base=secure_base, digest=digest, proportions=proportions,
            pair_groups=params.pair_groups, epsilon=eps_s, delta=delta_s, among=among,
            rho=rho_share(params, eps_s, delta_s))
        total_scores = check_vector(np.asarray(raw, dtype=np.float64), len(candidates),
                                    "pooled pair scores")
        scored = list(outcomes["pair_scores"].plan.participants)
    else:
        r_scores = await ctx.dispatch(
            kind, {**base, "round": "pair_scores", "links_digest": digest},
            round_name="pair_scores", arrays=link_arrays, epsilon=eps_s, delta=delta_s,
            check_result=_checker("pair_scores", len(candidates), "pair scores"),
            progress=(0.74, 0.8), only=among)
        scored = sorted(r_scores)
        total_scores = np.sum([r_scores[s].arrays["pair_scores"] for s in scored], axis=0)
        out_results["pair_scores"] = r_scores
    edges = pair_forest(total_scores, grid, most, pair_noise(params, eps_t, delta_t, len(scored))
                        if params.pair_gate else None)
    if not edges:
        ctx.emit("pairs", "no pair's noisy score is above the noise its table would carry: "
                 "the pairs round is skipped (nothing is charged for it)", 0.8)
        n_scored = (outcomes["pair_scores"].n_rows_total if secure else
                    sum(int(r_scores[s].metadata["n_rows"]) for s in scored))
        return PairRounds(grid, candidates, [], [], scored, n_scored, 0.0, out_results,
                          outcomes)
    cells = sum(grid.cells(e) for e in edges)
    names = schema.names
    ctx.emit("pairs", f"measuring {len(edges)} pair table(s) ({cells} cells): "
             + ", ".join(f"{names[a]}->{names[b]}" for a, b in edges), 0.8)
    if secure:
        raw, outcomes["pairs"] = await secure_pair_tables(
            ctx, schema=schema, base=secure_base, digest=digest, proportions=proportions,
            pair_groups=params.pair_groups, edges=edges, epsilon=eps_t, delta=delta_t,
            among=scored, rho=rho_share(params, eps_t, delta_t))
        total_tables = check_vector(np.asarray(raw, dtype=np.float64), cells,
                                    "pooled pair tables")
        sites = list(outcomes["pairs"].plan.participants)
        n_total = outcomes["pairs"].n_rows_total
        noise_sd = math.sqrt(outcomes["pairs"].plan.pooled_variance)  # counts: scale 1
    else:
        r_tables = await ctx.dispatch(
            kind, {**base, "round": "pairs", "links_digest": digest,
                   "pair_edges": [[a, b] for a, b in edges]},
            round_name="pairs", arrays=link_arrays, epsilon=eps_t, delta=delta_t,
            check_result=_checker("pair_tables", cells, "pair tables"),
            progress=(0.82, 0.88), only=scored)
        sites = sorted(r_tables)
        total_tables = np.sum([r_tables[s].arrays["pair_tables"] for s in sites], axis=0)
        n_total = sum(int(r_tables[s].metadata["n_rows"]) for s in sites)  # public N_s
        noise_sd = pair_table_mechanism(len(edges), eps_t, delta_t).sigma * math.sqrt(
            len(sites))
        out_results["pairs"] = r_tables
    tables = await asyncio.to_thread(fit_pair_tables, total_tables, grid, edges, proportions,
                                     float(n_total))
    log.info("[synth_pairs.run_pair_rounds] job=%s edges=%s sites=%s", ctx.job_id, edges,
             sites)
    return PairRounds(grid, candidates, edges, tables, sites, n_total, noise_sd, out_results,
                      outcomes)
