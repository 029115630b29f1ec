"""Coordinator side of the ``synth`` job: the rounds in order, then the factor model.

``links`` gives the DP proportions and the links built from them; ``pca`` (among the sites
whose counts built the links) the DP second moment of the latent rows; generative mode fits
the model and, with pair rounds, scores the column pairs, picks a forest of them and fits
the model to their DP 2-way tables; row-aligned mode releases the sites' noisy factor rows.
Each later round goes only to the sites of the round before: a site that joins late never
gets a round computed from sums it did not take part in. Every task is a deterministic
function of the job's parameters and the earlier (replayed) releases, so a resumed job
re-sends the same tasks. The result file is the fitted
:class:`dpfed.aggregator.synth_model.SynthModel`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.aggregator.jobs.records import secure_record
from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.evaluation.holdout import holdout_size, training_count
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs.contract import Pooled
from dpfed.common.jobs.synth import check_budget_for_cells, pair_noise, pair_noise_note
from dpfed.common.jobs.synth_evaluation import EVALUATE, EVALUATE_SUMMARY, Sample, sample_arrays
from dpfed.common.jobs.synth_pairs import PAIR_SCORES, PAIRS, PairInput
from dpfed.common.jobs.synth_rounds import (
    FACTORS,
    LATENT,
    LINKS,
    LinksInput,
    LoadingsInput,
    cells_schema,
    proportions,
)
from dpfed.common.privacy.rng import production_rng
from dpfed.common.synth.factor_model import dp_second_moment
from dpfed.common.synth.generative import fit_factor_model
from dpfed.common.synth.link_release import links_digest, links_from_proportions
from dpfed.common.synth.links import default_clip_norm, latent_dim
from dpfed.common.synth.pair_marginals import MAX_PAIR_CELLS, Pair, PairGrid, fit_pair_tables
from dpfed.common.synth.pipeline import pair_forest, row_aligned_model

log = logging.getLogger(__name__)

#: Most cells of the fitted joint tables the model's metadata keeps for the report.
MAX_REPORTED_CELLS = 20_000


async def run(job: Job[SynthParams]) -> JobOutput:
    """Run the rounds and fit the model (post-processing only)."""
    params = job.params
    schema = job.federation.schema
    cells = cells_schema(schema, params)  # a missing cell per "category" column (new jobs)
    dim = latent_dim(cells)
    _check_budget(job)
    counts = await job.release(LINKS, None)
    props = proportions(counts.value, schema, params)
    links_in = LinksInput(props, links_digest(cells, props, params.n_bins,
                                              params.continuous_link, params.resolution))
    links = await asyncio.to_thread(links_from_proportions, cells, props, params.n_bins,
                                    params.continuous_link, params.resolution)
    job.emit("links", f"links built from {len(counts.rows)} site(s)' pooled counts (digest "
             f"{links_in.digest[:12]})")
    moment = await job.release(LATENT, links_in, among=counts.participants)
    estimate = moment.value
    released: list[Pooled[Any]] = [counts, moment]
    clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)
    dp_corr = _correlation(dp_second_moment(estimate, dim))
    rng = production_rng()  # post-processing only (simulation, sampling)
    job.emit("model", f"fitting the factor model (latent dimension {dim})", 0.72)
    factors: np.ndarray | None = None
    corr: np.ndarray | None = None
    pairs: PairsFitted | None = None
    if params.mode == "generative":
        fm, corr = await asyncio.to_thread(
            fit_factor_model, estimate, links, clip_norm=clip, rng=rng, rank=params.rank,
            info_threshold=params.info_threshold, n_rows=counts.value.n_rows)
        if params.pair_rounds:
            pairs = await _pair_rounds(job, links_in, released)
    else:
        fm_plain, _ = await asyncio.to_thread(
            fit_factor_model, estimate, links, clip_norm=clip, rng=rng, rank=params.rank,
            info_threshold=params.info_threshold, correct_correlation=False)
        rows = await job.release(FACTORS, LoadingsInput(links_in, fm_plain.loadings),
                                 among=moment.participants)
        released.append(rows)
        fm = row_aligned_model(links, fm_plain.loadings, fm_plain.eigenvalues, clip_norm=clip,
                               noise_scale=rows.value.noise_scale)
        factors = rows.value.rows
    last = released[-1]
    job.emit("calibrate", "calibrating every column to its released DP marginal", 0.92)
    metadata = _metadata(job, released, {**counts.rows, **moment.rows}, last,
                         float(estimate.total_variance), fm.rank)
    if pairs is not None:
        metadata.update(pairs.metadata(schema))
    elif params.pair_rounds:
        metadata["pair_edges"] = []  # no candidate pair: both rounds skipped, uncharged
    model = await asyncio.to_thread(
        SynthModel.build, schema, mode=params.mode, continuous_link=params.continuous_link,
        n_bins=params.n_bins, proportions=props, factor_model=fm, dp_correlation=dp_corr,
        rng=rng, latent_correlation=corr, factors=factors, metadata=metadata,
        resolution=params.resolution, missing_cells=params.missing_cells)
    if pairs is not None:
        job.emit("pairs", f"fitting the model to {len(pairs.edges)} DP pair table(s)", 0.95)
        model = await asyncio.to_thread(model.with_pairs, pairs.grid, pairs.edges,
                                        pairs.tables, rng,
                                        noise_sd=pairs.noise_sd / max(pairs.n_rows, 1))
    summary: dict[str, Any] = {
        "mode": params.mode, "aggregation": params.aggregation, "latent_dim": dim,
        "rank": fm.rank, "sites": len(last.rows), "n_rows_total": metadata["n_rows_total"],
        "links_digest": links_in.digest, "pairs": 0 if pairs is None else len(pairs.edges)}
    if "secure" in metadata:
        summary["tolerated_colluders"] = metadata["secure"]["tolerated_colluders"]
    if params.evaluate_rows:
        evaluation = await _evaluate(job, model, last.participants)
        model.metadata["evaluation"] = evaluation
        summary["evaluated_sites"] = evaluation["local_report_sites"]
        if "summaries" in evaluation:
            summary["summary_sites"] = sorted(evaluation["summaries"])
    return JobOutput(model.arrays(), model.file_metadata(), summary)


def _check_budget(job: Job[SynthParams]) -> None:
    """Refuse a budget whose histograms would be mostly noise; warn of noisy pair tables.

    Public numbers only: the schema, the split, the sites' row counts.
    """
    params = job.params
    rows = [s.hello.row_count for s in job.registry.connected()
            if not job.spec.sites or s.site_id in job.spec.sites]
    if params.evaluate_rows:
        rows = [training_count(n) for n in rows]  # the holdout trains nothing
    if not rows or min(rows) <= 0:
        return
    schema = cells_schema(job.federation.schema, params)
    check_budget_for_cells(schema, params, job.spec.epsilon, job.spec.delta, rows)
    noisy = pair_noise_note(schema, params, job.spec.epsilon, job.spec.delta, rows)
    if noisy:
        job.emit("plan", noisy, 0.0)
        log.warning("job=%s %s", job.job_id, noisy)


# --------------------------------------------------------------------------- pair rounds


@dataclass(frozen=True)
class PairsFitted:
    """What the pair rounds produced.

    The grid, the candidates and chosen edges, the fitted joint proportions per edge, and the
    public numbers the correction shrinks by.
    """

    grid: PairGrid
    candidates: list[Pair]
    edges: list[Pair]
    tables: list[np.ndarray]
    n_rows: int
    noise_sd: float

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


def plan_pairs(schema: Schema, params: SynthParams, props: np.ndarray
               ) -> tuple[PairGrid, list[Pair], int] | None:
    """Return (grid, candidates, most edges), or None when the pair rounds do not apply."""
    most = params.max_pairs(len(schema.columns))
    if not params.pair_rounds or most == 0:
        return None
    grid = PairGrid.from_proportions(cells_schema(schema, params), props, params.n_bins,
                                     params.pair_groups, params.resolution)
    candidates = grid.candidate_pairs()
    if not candidates:
        log.info("no pair table has at most %d cells; pair rounds skipped", MAX_PAIR_CELLS)
        return None
    return grid, candidates, most


async def _pair_rounds(job: Job[SynthParams], links: LinksInput,
                       released: list[Pooled[Any]]) -> PairsFitted | None:
    """``pair_scores`` then ``pairs`` among the sites of the round before; None if skipped."""
    schema = job.federation.schema
    planned = plan_pairs(schema, job.params, links.proportions)
    if planned is None:
        job.emit("pairs", "pair rounds skipped (no column pair has a small enough table)",
                 0.74)
        return None
    grid, candidates, most = planned
    asked = PairInput(links, grid, candidates, [])
    job.emit("pair_scores", f"scoring {len(candidates)} column pair(s) at "
             f"{len(released[-1].rows)} site(s)", 0.74)
    scores = await job.release(PAIR_SCORES, asked, among=released[-1].participants)
    released.append(scores)
    budget = job.budget(PAIRS.name)
    edges = pair_forest(scores.value, grid, most,
                        pair_noise(job.params, budget.epsilon, budget.delta, len(scores.rows))
                        if job.params.pair_gate else None)
    if not edges:
        job.emit("pairs", "no pair's noisy score is above the noise its table would carry: "
                 "the pairs round is skipped (nothing is charged for it)", 0.8)
        return PairsFitted(grid, candidates, [], [], scores.n_rows_total, 0.0)
    names = schema.names
    job.emit("pairs", f"measuring {len(edges)} pair table(s) "
             f"({sum(grid.cells(e) for e in edges)} cells): "
             + ", ".join(f"{names[a]}->{names[b]}" for a, b in edges), 0.8)
    tables = await job.release(PAIRS, asked.with_edges(edges), among=scores.participants)
    released.append(tables)
    fitted = await asyncio.to_thread(fit_pair_tables, tables.value.total, grid, edges,
                                     links.proportions, float(tables.value.n_rows))
    log.info("job=%s edges=%s sites=%s", job.job_id, edges, tables.participants)
    return PairsFitted(grid, candidates, edges, fitted, tables.value.n_rows,
                       tables.value.noise_sd)


# --------------------------------------------------------------------------- metadata


def _metadata(job: Job[SynthParams], released: list[Pooled[Any]], n_rows: dict[str, int],
              last: Pooled[Any], total_variance: float, rank: int) -> dict[str, Any]:
    """Sites' rows and per-round charges, the plan and the mode (file metadata)."""
    params = job.params
    hello_rows = {s.site_id: s.hello.row_count for s in job.registry.connected()}
    sites = []
    for s in sorted(n_rows):
        row: dict[str, Any] = {"site_id": s, "n_rows": n_rows[s]}
        if params.evaluate_rows and s in hello_rows:
            row["n_holdout"] = holdout_size(hello_rows[s])
        for p in released:
            if s in p.spend:
                row[f"{p.name}_epsilon"] = p.spend[s].epsilon
                row[f"{p.name}_delta"] = p.spend[s].delta
        sites.append(row)
    plan = params.plan(job.spec.epsilon, job.spec.delta)
    return {"job_id": job.job_id, "kind": job.kind.name, "epsilon": job.spec.epsilon,
            "delta": job.spec.delta, "params": params.to_mapping(),
            "aggregation": params.aggregation,
            "plan": [{"round": n, "epsilon": e, "delta": d} for n, e, d in plan],
            "sites": sites, "rounds": {p.name: p.participants for p in released},
            "n_rows_total": sum(n_rows.get(s, 0) for s in last.rows),
            "rank": rank, "total_variance": total_variance,
            "software_version": __version__, **secure_record(*released)}


def _correlation(moment: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.clip(np.diag(moment), 1e-300, None))
    return np.asarray(moment / d[:, None] / d[None, :])


# --------------------------------------------------------------------------- evaluation


async def _evaluate(job: Job[SynthParams], model: SynthModel,
                    model_sites: list[str]) -> dict[str, Any]:
    """Return the evaluation rounds at the model's sites; what the model records of them."""
    params = job.params
    sample = EncodedTable.concatenate(list(model.iter_encoded(
        None if model.factors is not None else params.evaluate_rows)))
    take = min(sample.n_rows, params.evaluate_rows)
    asked = Sample(sample_arrays(sample, take), take)
    job.emit("evaluate", f"sending a {take}-row synthetic sample to {len(model_sites)} "
             "site(s) for their local evaluation (nothing comes back, nothing is charged)",
             0.95)
    local = await job.release(EVALUATE, asked, among=model_sites)
    out: dict[str, Any] = {"sample_rows": take, "local_report_sites": local.value}
    if params.summary_epsilon <= 0:
        return out
    allowing = [s for s in model_sites if s in job.sites_allowing(EVALUATE_SUMMARY.task_kind)]
    out.update(summary_epsilon=params.summary_epsilon, summary_delta=params.summary_delta,
               summary_sites_asked=allowing, summaries={})
    if not allowing:
        job.emit("evaluate", "no site of the model allows DP evaluation summaries (policy "
                 "evaluation_summary = \"dp\"); nothing was asked or charged", 0.99)
        return out
    job.emit("evaluate", f"asking {len(allowing)} site(s) whose policy allows it for a DP "
             f"summary of their evaluation (epsilon {params.summary_epsilon:g}, delta "
             f"{params.summary_delta:g} each)", 0.97)
    summaries = await job.release(EVALUATE_SUMMARY, asked, among=allowing)
    out["summaries"] = summaries.value
    return out
