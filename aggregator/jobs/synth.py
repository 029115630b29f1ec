"""Coordinator side of the ``synth`` job: federated DP synthesis with the factor model.

Rounds (each one ``JobContext.dispatch`` with its own round name, so a resumed job re-sends
identical tasks and the sites replay their ledgers):

1. ``links`` -- every site releases DP histograms of every column; the coordinator sums them
   and builds the links (quantile links for continuous columns by default).
2. ``pca`` -- the coordinator sends the DP proportions and their digest; every site releases
   its DP-PCA factor of the unit-ball latent rows; the coordinator combines them, chooses the
   rank, corrects the latent correlation and rescales.
3. ``factors`` (row-aligned mode only; task kind ``synth_rows``, which a site must allow
   explicitly) -- the coordinator sends the DP loadings; every site releases one noisy factor
   row per real row.

Generative mode with ``pairs > 0`` (the default) runs two more rounds after ``pca``
(:mod:`dpfed.aggregator.jobs.synth_pairs`): ``pair_scores`` -- every site releases noisy
dependence scores of the candidate column pairs and the coordinator picks a forest of pairs
from their sum -- and ``pairs`` -- every site releases the pairs' noisy 2-way tables; the
model is then fitted to those tables
(:meth:`dpfed.aggregator.synth_model.SynthModel.with_pairs`, post-processing, before the
evaluation rounds).

With ``aggregation="secure"`` (generative mode only) rounds 1 and 2 are secure sums instead
(:mod:`dpfed.aggregator.jobs.synth_secure`): the sites' exact count vectors, then the Gram
matrix of their unit-ball latent rows, each with distributed Skellam noise calibrated to one row
of the pooled data; the coordinator sees only the noisy totals.

Rounds after the first go only to the sites that answered the round before (``only=``): a
site that joins or comes back late never gets a round computed from sums it did not take
part in, and a site that drops out is not asked again (the quorum decides whether the job
goes on; what it was charged stays in its ledger). The model's metadata records which sites
each round used (``rounds``). With an evaluation (``evaluate_rows``), every site holds out
``holdout_size(N_s)`` rows from every round and reports its public training count as
``n_rows``; the evaluation rounds run in :mod:`dpfed.aggregator.jobs.synth_evaluation`.

The task parameters of each round are a deterministic function of the job's parameters and
of the earlier rounds' (replayed) releases, so a coordinator restarted between rounds sends
the same task ids with the same payloads: one charge per site per round. (If a site that
answered round 1 before the restart does not come back within the resume wait, round 1's sum
changes, so do the links and their digest; a site that had already answered round 2 then
refuses the re-sent round 2 as a conflicting payload instead of being charged twice.)
The job's result file is the fitted :class:`dpfed.aggregator.synth_model.SynthModel`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.base import JobContext, JobOutput, JobType
from dpfed.aggregator.jobs.secure_rounds import SecureSumOutcome
from dpfed.aggregator.jobs.synth_evaluation import run_evaluation
from dpfed.aggregator.jobs.synth_pairs import PairRounds, run_pair_rounds
from dpfed.aggregator.jobs.synth_secure import (
    counts_sigma,
    pooled_counts_sigma,
    rho_share,
    secure_latent_pca,
    secure_links,
    secure_metadata,
)
from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.evaluation.holdout import holdout_size, training_count
from dpfed.common.job_params import SynthParams
from dpfed.common.pca.dppca import PCAEstimate
from dpfed.common.privacy.composition import rounds_rho
from dpfed.common.privacy.rng import production_rng
from dpfed.common.synth.factor_model import dp_second_moment
from dpfed.common.synth.generative import FactorModel, fit_factor_model
from dpfed.common.synth.link_release import (
    expected_proportion_error,
    histogram_sizes,
    link_histogram_mechanism,
    links_digest,
    links_from_proportions,
    proportions_from_histograms,
    release_noise_sd,
    sum_histograms,
)
from dpfed.common.synth.links import default_clip_norm, latent_dim
from dpfed.common.synth.pair_marginals import (
    NOISY_PAIR_TABLES,
    expected_pair_table_error,
    pair_table_mechanism,
    typical_pair_cells,
)
from dpfed.common.synth.pipeline import combine_factors, row_aligned_model
from dpfed.common.transport.protocol import JobSpec, TaskResult
from dpfed.common.validation import check_delta, check_epsilon

log = logging.getLogger(__name__)

#: Largest expected L1 error of a column's pooled DP proportions a job may start with.
MAX_PROPORTION_ERROR = 0.5
#: Task kind of the row-aligned factors round (sites must allow it explicitly).
ROWS_KIND = "synth_rows"
#: Largest row-aligned output the coordinator accepts from one site.
MAX_ALIGNED_ROWS = 50_000_000


def check_synth_schema(schema: Schema) -> None:
    """Require at least two columns (a joint model of one column is its marginal)."""
    if len(schema.columns) < 2:
        raise ValidationError(
            f"the federation schema has {len(schema.columns)} column(s); synth needs at least "
            "2 (ordinal, nominal or continuous)")


def check_budget_for_cells(schema: Schema, params: SynthParams, epsilon: float, delta: float,
                           row_counts: list[int]) -> None:
    """Refuse budgets whose histograms would be mostly noise (before anything is charged)."""
    eps, dlt = params.plan(epsilon, delta)[0][1:]
    pooled = (pooled_counts_sigma(schema, params.n_bins, eps, dlt, params.resolution)
              if params.aggregation == "secure" else None)
    name, err = expected_proportion_error(schema, params.n_bins, epsilon=eps, delta=dlt,
                                          row_counts=row_counts, pooled_sigma=pooled,
                                          resolution=params.resolution)
    if err > MAX_PROPORTION_ERROR:
        raise ValidationError(
            f"--epsilon {epsilon:g} / --delta {delta:g} are too small for this schema's cells: "
            f"the DP histogram of {name!r} would have an expected L1 error of {err:.2f} on "
            f"its proportions with {sum(row_counts)} rows at {len(row_counts)} site(s) "
            f"(limit {MAX_PROPORTION_ERROR}); raise --epsilon/--delta or lower --n-bins")


def pair_noise_note(schema: Schema, params: SynthParams, epsilon: float, delta: float,
                    row_counts: list[int]) -> str | None:
    """Return a warning when the pair tables would be mostly noise at this budget, else None.

    Computed from public numbers only (schema, budget split, the sites' row counts): the
    expected L1 error of a typical pair table
    (:func:`~dpfed.common.synth.pair_marginals.expected_pair_table_error`) above
    :data:`~dpfed.common.synth.pair_marginals.NOISY_PAIR_TABLES`. The job still runs as
    planned (the correction then keeps the model's tables for most pairs).
    """
    if not params.pair_rounds or not row_counts or min(row_counts) < 1:
        return None
    k = params.max_pairs(len(schema.columns))
    cells = typical_pair_cells(schema, params.n_bins, params.pair_groups)
    if k == 0 or cells == 0:
        return None
    eps, dlt = {n: (e, d) for n, e, d in params.plan(epsilon, delta)}["pairs"]
    if params.aggregation == "secure":
        sigma = counts_sigma(k, eps, dlt)
    else:
        sigma = pair_table_mechanism(k, eps, dlt).sigma * math.sqrt(len(row_counts))
    err = expected_pair_table_error(cells, sigma, sum(row_counts))
    if err <= NOISY_PAIR_TABLES:
        return None
    return (f"at this budget a typical pair table ({cells} cells, {sum(row_counts)} rows at "
            f"{len(row_counts)} site(s)) has an expected L1 error of {err:.2f} on its "
            "proportions: mostly noise, so the correction will keep the model's tables for "
            "most pairs; --pairs 0 gives that budget back to the marginals"
            + ("" if params.aggregation == "secure" else
               " (--aggregation secure adds the noise once instead of at every site)"))


def plan_table(params: SynthParams, epsilon: float, delta: float) -> list[dict[str, Any]]:
    """Return the per-round budget every site will be charged (what ``--plan`` prints)."""
    return [{"round": n, "epsilon": e, "delta": d} for n, e, d in params.plan(epsilon, delta)]


class SynthJob(JobType):
    """Two or four (generative) or three (row-aligned) rounds; the result is a SynthModel."""

    kind = "synth"

    def validate(self, spec: JobSpec, federation: Federation) -> dict[str, Any]:
        """Validate the mode, links, bins and budget split against the federation schema."""
        epsilon = check_epsilon(spec.epsilon)
        delta = check_delta(spec.delta)
        check_synth_schema(federation.schema)
        params = SynthParams.from_mapping(SynthParams.with_defaults(spec.params),
                                          latent_dim=latent_dim(federation.schema))
        params.check_privacy(epsilon, delta)
        return params.to_mapping()

    async def run(self, ctx: JobContext) -> JobOutput:
        """Run the rounds and fit the model (post-processing only)."""
        schema = ctx.federation.schema
        dim = latent_dim(schema)
        params = SynthParams.from_mapping(ctx.params, latent_dim=dim)
        plan = params.plan(ctx.spec.epsilon, ctx.spec.delta)
        budget = {name: (eps, dlt) for name, eps, dlt in plan}
        secure = params.aggregation == "secure"
        rows = [s.hello.row_count for s in ctx.registry.connected()
                if not ctx.spec.sites or s.site_id in ctx.spec.sites]
        if params.evaluate_rows:
            rows = [training_count(n) for n in rows]  # the holdout trains nothing
        if rows and min(rows) > 0:
            check_budget_for_cells(schema, params, ctx.spec.epsilon, ctx.spec.delta, rows)
            noisy = pair_noise_note(schema, params, ctx.spec.epsilon, ctx.spec.delta, rows)
            if noisy:
                ctx.emit("plan", noisy, 0.0)
                log.warning("[SynthJob.run] job=%s %s", ctx.job_id, noisy)
        base = {**params.to_mapping(), "schema_digest": schema.digest()}
        secure_base = {"job": params.to_mapping(), "schema_digest": schema.digest()}
        size = sum(histogram_sizes(schema, params.n_bins, params.resolution))
        if secure:
            ctx.refuse_over_budget(rho=rounds_rho(plan))
        if params.composition == "zcdp":
            ctx.require_accountant(
                "zcdp", "--composition zcdp; a 'basic' ledger would be charged "
                f"{sum(e for _, e, _ in plan):.3g} epsilon for this epsilon={ctx.spec.epsilon:g} "
                "job")

        # ---------------------------------------------------------------- round 1: links
        def check_links(result: TaskResult) -> None:
            _check_rows(result)
            h = result.arrays.get("histograms")
            if h is None or h.shape != (size,) or h.dtype != np.float64 or not np.all(
                    np.isfinite(h)) or float(np.abs(h).max(initial=0.0)) > 1e12:
                raise ProtocolError(f"expected finite float64 histograms of shape ({size},)")

        links_eps, links_delta = budget["links"]
        secure_outcomes: dict[str, SecureSumOutcome] = {}
        if secure:
            pooled = await secure_links(ctx, schema=schema, params=params, base=secure_base,
                                        epsilon=links_eps, delta=links_delta,
                                        rho=rho_share(params, links_eps, links_delta))
            secure_outcomes["links"] = pooled.outcome
            r1 = {}
            order = list(pooled.outcome.plan.participants)
            total = pooled.counts
            pooled_rows = pooled.outcome.n_rows_total
            noise_sd = release_noise_sd(schema, params.n_bins,
                                        math.sqrt(pooled.outcome.plan.pooled_variance),
                                        params.resolution, secure=True)
        else:
            r1 = await ctx.dispatch(self.kind, {**base, "round": "links"}, round_name="links",
                                    epsilon=links_eps, delta=links_delta,
                                    check_result=check_links, progress=(0.05, 0.3))
            order = sorted(r1)
            total = sum_histograms([r1[s].arrays["histograms"] for s in order], schema,
                                   params.n_bins, params.resolution)
            pooled_rows = sum(int(r1[s].metadata["n_rows"]) for s in order)  # public N_s
            noise_sd = release_noise_sd(
                schema, params.n_bins, link_histogram_mechanism(schema, links_eps, links_delta)
                .sigma * math.sqrt(len(order)), params.resolution)
        proportions = proportions_from_histograms(total, schema, params.n_bins,
                                                  n_rows=pooled_rows,
                                                  resolution=params.resolution,
                                                  noise_sd=noise_sd)
        digest = links_digest(schema, proportions, params.n_bins, params.continuous_link,
                              params.resolution)
        links = await asyncio.to_thread(links_from_proportions, schema, proportions,
                                        params.n_bins, params.continuous_link,
                                        params.resolution)
        ctx.emit("links", f"links built from {len(order)} site(s)' "
                 f"{'secure pooled counts' if secure else 'DP histograms'} "
                 f"(digest {digest[:12]})", 0.32)

        # ---------------------------------------------------------------- round 2: pca
        def check_factor(result: TaskResult) -> None:
            _check_rows(result)
            f = result.arrays.get("factor")
            if f is None or f.shape != (dim, dim) or f.dtype != np.float64 or not np.all(
                    np.isfinite(f)) or float(np.abs(f).max(initial=0.0)) > 1e6:
                raise ProtocolError(f"expected a finite float64 factor of shape ({dim}, {dim})")

        pca_eps, pca_delta = budget["pca"]
        link_arrays = {"link_proportions": proportions}
        if secure:
            estimate, secure_outcomes["pca"] = await secure_latent_pca(
                ctx, schema=schema, base=secure_base, digest=digest, proportions=proportions,
                epsilon=pca_eps, delta=pca_delta, among=order,
                rho=rho_share(params, pca_eps, pca_delta))
            r2 = {}
        else:
            r2 = await ctx.dispatch(self.kind, {**base, "round": "pca", "links_digest": digest},
                                    round_name="pca", arrays=link_arrays, epsilon=pca_eps,
                                    delta=pca_delta, check_result=check_factor,
                                    progress=(0.35, 0.7), only=order)
            sites2 = sorted(r2)
            estimate = await asyncio.to_thread(
                combine_factors, [r2[s].arrays["factor"] for s in sites2],
                [int(r2[s].metadata["n_rows"]) for s in sites2], dim)
        clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)
        dp_corr = _correlation(dp_second_moment(estimate, dim))
        rng = production_rng()  # post-processing only (simulation, sampling)
        ctx.emit("model", f"fitting the factor model (latent dimension {dim})", 0.72)
        factors: np.ndarray | None = None
        corr: np.ndarray | None = None
        pair_rounds: PairRounds | None = None
        if params.mode == "generative":
            fm, corr = await asyncio.to_thread(
                fit_factor_model, estimate, links, clip_norm=clip, rng=rng, rank=params.rank,
                info_threshold=params.info_threshold, n_rows=pooled_rows)
            last_sites = (list(secure_outcomes["pca"].plan.participants) if secure
                          else sorted(r2))
            if params.pair_rounds:
                pair_rounds = await run_pair_rounds(
                    ctx, schema=schema, params=params, proportions=proportions, digest=digest,
                    base=base, secure_base=secure_base, budget=budget, among=last_sites,
                    kind=self.kind)
                if pair_rounds is not None:
                    last_sites = pair_rounds.sites
                    secure_outcomes.update(pair_rounds.secure)
        else:
            fm_plain, _ = await asyncio.to_thread(
                fit_factor_model, estimate, links, clip_norm=clip, rng=rng, rank=params.rank,
                info_threshold=params.info_threshold, correct_correlation=False)
            v = fm_plain.loadings
            f_eps, f_delta = budget["factors"]

            def check_w(result: TaskResult) -> None:
                n = _check_rows(result)
                w = result.arrays.get("factors")
                if w is None or w.shape != (n, v.shape[1]) or w.dtype != np.float64 or not (
                        np.all(np.isfinite(w))):
                    raise ProtocolError(f"expected finite float64 factors of shape "
                                        f"({n}, {v.shape[1]})")

            r3 = await ctx.dispatch(
                ROWS_KIND, {**base, "round": "factors", "links_digest": digest},
                round_name="factors", arrays={**link_arrays, "loadings": v},
                epsilon=f_eps, delta=f_delta, check_result=check_w, progress=(0.75, 0.9),
                only=sorted(r2))
            last_sites = sorted(r3)
            b = max(float(r.spend.noise_scale) for r in r3.values())
            fm = row_aligned_model(links, v, fm_plain.eigenvalues, clip_norm=clip,
                                   noise_scale=b)
            factors = np.concatenate([r3[s].arrays["factors"] for s in last_sites])
        ctx.emit("calibrate", "calibrating every column to its released DP marginal", 0.92)
        if secure:
            n_rows = {**secure_outcomes["links"].n_rows, **secure_outcomes["pca"].n_rows}
            spends = {name: dict.fromkeys(o.plan.participants, (o.plan.calibration.epsilon,
                                                                o.plan.calibration.delta))
                      for name, o in secure_outcomes.items()}
        else:
            n_rows = {s: int(r1[s].metadata["n_rows"]) for s in r1}
            spends = {name: {s: (r.spend.epsilon, r.spend.delta) for s, r in res.items()}
                      for name, res in (("links", r1), ("pca", r2))}
            if params.mode == "row_aligned":
                spends["factors"] = {s: (r.spend.epsilon, r.spend.delta) for s, r in r3.items()}
            for name, res in (pair_rounds.results if pair_rounds is not None else {}).items():
                spends[name] = {s: (r.spend.epsilon, r.spend.delta) for s, r in res.items()}
        metadata = self._metadata(ctx, params, plan, n_rows, spends, last_sites, estimate, fm)
        if pair_rounds is not None:
            metadata.update(pair_rounds.metadata(schema))
        elif params.pair_rounds:
            metadata["pair_edges"] = []  # no candidate pair: both rounds skipped, uncharged
        if secure:
            metadata["secure"] = secure_metadata(secure_outcomes)
        model = await asyncio.to_thread(
            SynthModel.build, schema, mode=params.mode, continuous_link=params.continuous_link,
            n_bins=params.n_bins, proportions=proportions, factor_model=fm,
            dp_correlation=dp_corr, rng=rng, latent_correlation=corr, factors=factors,
            metadata=metadata, resolution=params.resolution)
        if pair_rounds is not None:
            ctx.emit("pairs", f"fitting the model to {len(pair_rounds.edges)} DP pair "
                     "table(s)", 0.95)
            model = await asyncio.to_thread(
                model.with_pairs, pair_rounds.grid, pair_rounds.edges, pair_rounds.tables, rng,
                noise_sd=pair_rounds.noise_sd / max(pair_rounds.n_rows_total, 1))
        summary = {"mode": params.mode, "aggregation": params.aggregation,
                   "latent_dim": dim, "rank": fm.rank,
                   "sites": len(last_sites), "n_rows_total": metadata["n_rows_total"],
                   "links_digest": digest,
                   "pairs": 0 if pair_rounds is None else len(pair_rounds.edges)}
        if secure:
            summary["tolerated_colluders"] = metadata["secure"]["tolerated_colluders"]
        if params.evaluate_rows:
            evaluation = await run_evaluation(ctx, model, params, schema, sorted(last_sites))
            model.metadata["evaluation"] = evaluation
            summary["evaluated_sites"] = evaluation["local_report_sites"]
            if "summaries" in evaluation:
                summary["summary_sites"] = sorted(evaluation["summaries"])
        return JobOutput(model.arrays(), model.file_metadata(), summary)

    def _metadata(self, ctx: JobContext, params: SynthParams,
                  plan: list[tuple[str, float, float]], n_rows: dict[str, int],
                  spends: dict[str, dict[str, tuple[float, float]]], last: list[str],
                  estimate: PCAEstimate, fm: FactorModel) -> dict[str, Any]:
        """Sites' rows and per-round charges, the plan and the mode (file metadata)."""
        sites = []
        hello_rows = {s.site_id: s.hello.row_count for s in ctx.registry.connected()}
        for s in sorted(n_rows):
            row: dict[str, Any] = {"site_id": s, "n_rows": n_rows[s]}
            if params.evaluate_rows and s in hello_rows:
                row["n_holdout"] = holdout_size(hello_rows[s])
            for name, charged in spends.items():
                if s in charged:
                    row[f"{name}_epsilon"], row[f"{name}_delta"] = charged[s]
            sites.append(row)
        return {"job_id": ctx.job_id, "kind": self.kind, "epsilon": ctx.spec.epsilon,
                "delta": ctx.spec.delta, "params": params.to_mapping(),
                "aggregation": params.aggregation,
                "plan": [{"round": n, "epsilon": e, "delta": d} for n, e, d in plan],
                "sites": sites,
                "rounds": {name: sorted(charged) for name, charged in spends.items()},
                "n_rows_total": sum(n_rows.get(s, 0) for s in last),
                "rank": fm.rank, "total_variance": float(estimate.total_variance),
                "software_version": __version__}


def _rounds_used(params: SynthParams, *results: dict[str, Any]) -> dict[str, list[str]]:
    """Which sites' releases each round of the model used (round name -> sorted site ids)."""
    names = ("links", "pca", "factors") if params.mode == "row_aligned" else ("links", "pca")
    return {name: sorted(r) for name, r in zip(names, results, strict=False)}


def _check_rows(result: TaskResult) -> int:
    n = result.metadata.get("n_rows")
    if not isinstance(n, int) or n <= 0 or n > MAX_ALIGNED_ROWS:
        raise ProtocolError("result lacks a valid positive n_rows")
    return n


def _correlation(moment: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.clip(np.diag(moment), 1e-300, None))
    return np.asarray(moment / d[:, None] / d[None, :])

