"""Coordinator side of the ``query`` job: choose the strategy, one release, reconstruct.

The strategy is ranked for the noise the pooled answers will carry (one draw per site, or
one draw for a secure sum), sent verifiably, and the pooled answers are reconstructed (least
squares, or NNLS / the seed's L1 programme on request); every answer comes with its
closed-form standard error for the sites that answered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.aggregator.jobs.records import mode_record, secure_record
from dpfed.common.job_params import SECURE_NOISE_FAMILY, QueryParams
from dpfed.common.jobs.contract import Budget
from dpfed.common.jobs.query import QUERY, choose
from dpfed.common.queries.federated_matrix import per_query_std_error
from dpfed.common.queries.matrix_mechanism import reconstruct
from dpfed.common.queries.workloads import identity_workload


def other_mode(params: QueryParams, workload: Any, budget: Budget, modes: dict[str, Any],
               rmse: float, secure: bool) -> dict[str, Any] | None:
    """Return ``modes`` with the other aggregation mode's expected RMSE per query.

    The other mode is priced with its best strategy under its own noise
    (:meth:`~dpfed.common.job_params.QueryParams.mode_errors`: site-level Laplace can beat a
    secure Skellam sum, rarely a secure discrete Laplace); this job's own ``rmse`` stands for
    its mode. None when the secure noise cannot run (Skellam in a pure-epsilon job).
    """
    from dpfed.common.jobs.modes import compare_modes, secure_pooled_factor

    if not params.secure_noises(budget.delta):
        return None
    n, t, d = modes["n_sites"], modes["tolerated"], modes["dropouts"]
    errors = params.mode_rmse(workload, budget.epsilon, budget.delta, n,
                              secure_pooled_factor(n, t, d))
    site, secure_rmse = (errors[0], rmse) if secure else (rmse, errors[1])
    ratio, sentence = compare_modes(n, t, dropouts=d, errors=(site, secure_rmse))
    return {**modes, "secure_over_site_noise": ratio, "sentence": sentence,
            "expected_rmse_other_mode": site if secure else secure_rmse}


async def run(job: Job[QueryParams]) -> JobOutput:
    """Choose the strategy, release, reconstruct, answer with standard errors."""
    params = job.params
    schema = job.federation.schema
    # building a workload over up to 2,048 cells is matrix work: off the event loop
    domain, workload = await asyncio.to_thread(
        lambda: (params.domain_in(schema), params.workload_in(schema)))
    budget = job.budget(QUERY.name)
    draws = job.pooled_draws(QUERY)
    job.emit("strategy", f"choosing a strategy for {workload.name} over {domain.n_cells} "
             f"cells (candidates: {params.strategy}; {draws} noise draw(s) pooled)", 0.02)
    secure = job.planned(QUERY.name).secure
    chosen = await asyncio.to_thread(choose, params, workload, budget, draws=draws,
                                     secure=secure)
    pick = chosen.pick
    secure_names = {family: noise for noise, family in SECURE_NOISE_FAMILY.items()}
    noise_name = secure_names[pick.noise] if secure else pick.noise
    job.emit("strategy", f"strategy {pick.name} with {noise_name} noise: expected RMSE "
             f"{pick.rmse:.4g} per query (identity {pick.identity_rmse:.4g})", 0.04)
    released = await job.release(QUERY, chosen)
    answers = released.value
    recon = params.reconstruction
    job.emit("combine", f"summing {len(released.rows)} release(s), reconstructing ({recon})",
             0.92)
    x_hat = await asyncio.to_thread(reconstruct, answers.y, answers.strategy,
                                    nonnegative=None if recon == "least_squares" else recon)
    answer_se, cell_se = await asyncio.to_thread(
        lambda: (per_query_std_error(workload, answers.strategy,
                                     noise_variance=answers.noise_variance,
                                     n_sites=answers.draws),
                 per_query_std_error(identity_workload(domain.n_cells), answers.strategy,
                                     noise_variance=answers.noise_variance,
                                     n_sites=answers.draws)))
    rmse = float(np.sqrt(np.mean(answer_se ** 2)))
    # The ranking priced the expected draws and the site-level noise model; what the sum
    # actually carries differs from it by one factor for every strategy.
    factor = rmse / pick.rmse if pick.rmse > 0 else 1.0
    b = released.budget
    sites = [{"site_id": s, "n_rows": released.rows[s], "epsilon": released.spend[s].epsilon,
              "delta": released.spend[s].delta, "sensitivity": answers.sensitivity[s],
              "noise_scale": answers.noise_scale[s]} for s in released.participants]
    w = params.workload
    metadata: dict[str, Any] = {
        "job_id": job.job_id, "kind": "query", "epsilon": b.epsilon, "delta": b.delta,
        "domain": domain.to_json(), "workload": {"kind": w["kind"], "k": w.get("k", 0)},
        "workload_name": workload.name, "strategy": pick.name, "noise": answers.noise,
        "aggregation": params.aggregation, "strategy_digest": chosen.digest,
        "reconstruction": recon, "expected_rmse": rmse,
        "identity_expected_rmse": pick.identity_rmse * factor,
        "ranking": [[nm, secure_names[nz] if secure else nz, r * factor]
                    for nm, nz, r in pick.ranking],
        "sensitivity_exact": answers.sensitivity_exact, "sites": sites,
        "n_sites": len(sites), "n_rows_total": released.n_rows_total,
        "schema_toml": schema.to_toml(), "software_version": __version__,
        **secure_record(released)}
    modes = mode_record(job, released)
    if modes and modes["secure_over_site_noise"] is not None:
        compared = await asyncio.to_thread(other_mode, params, workload, budget, modes, rmse,
                                           released.secure is not None)
        if compared is not None:
            metadata["aggregation_comparison"] = compared
    summary = {"strategy": pick.name, "noise": answers.noise,
               "aggregation": params.aggregation, "cells": domain.n_cells,
               "queries": workload.n_queries, "sites": len(sites),
               "expected_rmse": round(rmse, 4),
               "identity_expected_rmse": round(pick.identity_rmse * factor, 4)}
    answered = await asyncio.to_thread(workload.answer, x_hat)
    out = {"x_hat": x_hat, "x_std_error": cell_se, "answers": answered,
           "answer_std_error": answer_se}
    if w["kind"] == "custom":
        out["workload_matrix"] = np.asarray(w["matrix"], dtype=np.float64)
    return JobOutput(out, metadata, summary)
